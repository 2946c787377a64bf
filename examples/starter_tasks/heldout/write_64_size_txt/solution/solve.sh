#!/bin/bash
# Reference solution (oracle).
echo 64 > /workdir/size.txt
