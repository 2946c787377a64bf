#!/bin/bash
# Reference solution (oracle).
cp /workdir/list.csv /workdir/copy.csv
