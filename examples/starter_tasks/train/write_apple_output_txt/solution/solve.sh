#!/bin/bash
# Reference solution (oracle).
echo apple > /workdir/output.txt
