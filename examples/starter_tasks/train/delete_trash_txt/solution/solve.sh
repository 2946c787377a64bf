#!/bin/bash
# Reference solution (oracle).
rm /workdir/trash.txt
