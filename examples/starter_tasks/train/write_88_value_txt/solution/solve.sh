#!/bin/bash
# Reference solution (oracle).
echo 88 > /workdir/value.txt
