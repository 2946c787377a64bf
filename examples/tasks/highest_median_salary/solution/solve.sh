#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv, statistics
from collections import defaultdict
by = defaultdict(list)
with open("data/employees.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        by[r["department"]].append(float(r["salary"]))
med = {d: statistics.median(v) for d, v in by.items()}
open("answer.txt", "w").write(max(med, key=med.get) + "\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
