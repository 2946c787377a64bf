#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv
from collections import defaultdict
with open("data/customers.csv", newline="") as fh:
    country = {r["customer_id"]: r["country"] for r in csv.DictReader(fh)}
totals = defaultdict(float)
with open("data/orders.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["status"] == "shipped":
            totals[country[r["customer_id"]]] += float(r["amount"])
open("answer.txt", "w").write(max(totals, key=totals.get) + "\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
