#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
from collections import defaultdict
by = defaultdict(list)
with open("data/trips.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["rider_type"] == "member":
            by[r["start_station"]].append(float(r["duration_min"]))
best = max(sum(v) / len(v) for v in by.values() if len(v) >= 25)
open("answer.txt", "w").write(f"{best:.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
