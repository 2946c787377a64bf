#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
with open("data/requests.csv", newline="") as fh:
    n = sum(1 for r in csv.DictReader(fh) if r["status"].strip() == "500")
open("answer.txt", "w").write(f"{n}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
