#!/bin/bash
# Reference solution (oracle).
echo lemon > /workdir/fruit.txt
