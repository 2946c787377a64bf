#!/bin/bash
# Reference solution (oracle).
rm /workdir/temp.dat
