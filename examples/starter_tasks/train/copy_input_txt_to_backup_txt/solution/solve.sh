#!/bin/bash
# Reference solution (oracle).
cp /workdir/input.txt /workdir/backup.txt
