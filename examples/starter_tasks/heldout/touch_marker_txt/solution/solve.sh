#!/bin/bash
# Reference solution (oracle).
touch /workdir/marker.txt
