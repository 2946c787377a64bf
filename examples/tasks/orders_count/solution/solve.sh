#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
with open("data/orders.csv", newline="") as fh:
    n = sum(1 for _ in csv.DictReader(fh))
open("answer.txt", "w").write(f"{n}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
