"""Print the side-by-side table of two or more train_synthetic.py summaries."""

import json
import sys

rows = [json.load(open(path)) for path in sys.argv[1:]]
dense = next((r for r in rows if r["density"] >= 1.0), rows[0])
print(f"{'mode':36s} {'final loss':>10s} {'bytes/step':>14s} {'vs dense':>9s} {'seconds':>8s}")
for r in rows:
    ratio = r["bytes_per_step"] / dense["bytes_per_step"]
    print(
        f"{r['mode']:36s} {r['final_loss']:10.4f} {r['bytes_per_step']:14,.0f} "
        f"{ratio:9.2%} {r['seconds']:8.1f}"
    )
