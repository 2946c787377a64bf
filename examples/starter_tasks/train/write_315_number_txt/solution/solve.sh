#!/bin/bash
# Reference solution (oracle).
echo 315 > /workdir/number.txt
