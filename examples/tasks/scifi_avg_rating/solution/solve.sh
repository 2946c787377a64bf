#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import json
books = json.load(open("data/books.json"))["books"]
sel = [b["rating"] for b in books if b["genre"] == "Science Fiction" and b["year"] >= 2010]
open("answer.txt", "w").write(f"{sum(sel) / len(sel):.2f}\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
