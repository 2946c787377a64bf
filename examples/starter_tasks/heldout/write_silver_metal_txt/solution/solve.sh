#!/bin/bash
# Reference solution (oracle).
echo silver > /workdir/metal.txt
