#!/bin/bash
# Verifier (Harbor runs /tests/test.sh after the agent; its exit code is ignored): writes 1 to
# /logs/verifier/reward.txt when the sandbox is in the state the instruction asks for, else 0.
mkdir -p /logs/verifier
trim() { local s="$1"; s="${s#"${s%%[![:space:]]*}"}"; s="${s%"${s##*[![:space:]]}"}"; printf '%s' "$s"; }
reward=0
[ -d /workdir/build ] && reward=1
echo "$reward" > /logs/verifier/reward.txt
exit 0
