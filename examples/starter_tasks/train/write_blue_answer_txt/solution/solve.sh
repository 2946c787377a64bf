#!/bin/bash
# Reference solution (oracle).
echo blue > /workdir/answer.txt
