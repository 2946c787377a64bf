#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import csv, json
with open("data/products.csv", newline="") as fh:
    prods = {r["product_id"]: r for r in csv.DictReader(fh)}
total = 0.0
for s in json.load(open("data/sales.json"))["sales"]:
    p = prods[s["product_id"]]
    if p["supplier"] == "Northwind Traders" and not s["returned"]:
        total += s["qty"] * (s["unit_price"] - float(p["unit_cost"]))
open("answer.txt", "w").write(f"{total:.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
