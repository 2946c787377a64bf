#!/bin/bash
# Reference solution (oracle): recomputes the answer from the data files.
set -euo pipefail
cd /workdir
python3 - <<'PY'
import json
from collections import defaultdict
from datetime import datetime
events = [json.loads(line) for line in open("data/events.jsonl") if line.strip()]
events.sort(key=lambda e: datetime.fromisoformat(e["ts"].replace("Z", "+00:00")))
open_at, total = {}, defaultdict(float)
for e in events:
    ts = datetime.fromisoformat(e["ts"].replace("Z", "+00:00"))
    if e["event"] == "login":
        open_at[e["user"]] = ts
    elif e["event"] == "logout" and e["user"] in open_at:
        total[e["user"]] += (ts - open_at.pop(e["user"])).total_seconds()
open("answer.txt", "w").write(max(total, key=total.get) + "\n")
PY
echo "answer: $(cat /workdir/answer.txt)"
