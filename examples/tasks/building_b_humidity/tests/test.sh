#!/bin/bash
# Verifier entry point (Harbor runs /tests/test.sh after the agent finishes; exit code ignored).
# Grades /workdir/answer.txt against $EXPECTED_ANSWER (see [verifier.env] in task.toml) and
# always leaves a reward file in /logs/verifier.
mkdir -p /logs/verifier
rm -f /logs/verifier/reward.txt /logs/verifier/reward.json
python3 /tests/grade.py
if [ ! -s /logs/verifier/reward.txt ] && [ ! -s /logs/verifier/reward.json ]; then
  echo "test.sh: grader left no reward; scoring 0" >&2
  echo 0 > /logs/verifier/reward.txt
fi
exit 0
