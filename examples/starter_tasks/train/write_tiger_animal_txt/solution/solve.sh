#!/bin/bash
# Reference solution (oracle).
echo tiger > /workdir/animal.txt
