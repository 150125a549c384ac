# Entry points. Every target bootstraps first, so each works on a fresh clone.
VENV   := .venv
PY     := $(VENV)/bin/python
RUN    := PATH=$(CURDIR)/$(VENV)/bin:$$PATH
DEMO_OUT := results/demo

.PHONY: bootstrap test lint unit parallel docs demo bench convergence cluster-bench

bootstrap:
	bash ci/bootstrap

lint: bootstrap
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy --strict --no-warn-unused-configs horovod_sparse/common  # imports no framework
	$(VENV)/bin/mypy horovod_sparse

unit: bootstrap
	$(RUN) $(PY) -m pytest -q -p no:cacheprovider tests/unit

parallel: bootstrap
	$(RUN) $(PY) -m tests.run_parallel

test: lint unit parallel

# Relative links and images of README.md and docs/*.md resolve; the README stays short.
docs: bootstrap
	$(RUN) $(PY) -m pytest -q -p no:cacheprovider tests/unit/test_docs.py

demo: bootstrap
	mkdir -p $(DEMO_OUT)
	$(RUN) horovodrun -np 2 -H localhost:2 --gloo $(PY) examples/pytorch/train_synthetic.py --density 1.0 --json $(DEMO_OUT)/dense.json
	$(RUN) horovodrun -np 2 -H localhost:2 --gloo $(PY) examples/pytorch/train_synthetic.py --density 0.01 --json $(DEMO_OUT)/sparse.json
	$(RUN) horovodrun -np 2 -H localhost:2 --gloo $(PY) examples/pytorch/train_synthetic.py --density 0.01 --scheduler auto --json $(DEMO_OUT)/auto.json
	$(PY) examples/compare.py $(DEMO_OUT)/dense.json $(DEMO_OUT)/sparse.json $(DEMO_OUT)/auto.json

# A quick subset (under 10 minutes on 2 cores); README "Performance" has the full commands.
bench: bootstrap
	$(RUN) $(PY) benchmarks/selection.py --steps 30 --recall-steps 30
	$(RUN) $(PY) benchmarks/allreduce.py --sizes 1M,16M --densities 0.01 --ranks 2,4 --repeats 5

# Accuracy of sparse vs dense on digits, Keras digits and a char LM (about 90 minutes).
convergence: bootstrap
	$(RUN) $(PY) benchmarks/convergence.py

# Needs root: network namespaces and tc (skips with a message otherwise).
cluster-bench: bootstrap
	$(RUN) $(PY) benchmarks/cluster/run.py
	$(RUN) $(PY) benchmarks/scaling.py
