#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
with open("data/students.csv", newline="") as fh:
    cohort = {r["student_id"]: r["cohort"] for r in csv.DictReader(fh)}
with open("data/grades.csv", newline="") as fh:
    sel = [float(r["score"]) for r in csv.DictReader(fh)
           if r["course"] == "Statistics" and cohort.get(r["student_id"]) == "Falcon"]
open("answer.txt", "w").write(f"{sum(sel) / len(sel):.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
