#!/bin/bash
# Reference solution (oracle).
echo river > /workdir/result.txt
