#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
with open("data/products.csv", newline="") as fh:
    best = max(csv.DictReader(fh), key=lambda r: float(r["unit_price"]))
open("answer.txt", "w").write(best["name"] + "\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
