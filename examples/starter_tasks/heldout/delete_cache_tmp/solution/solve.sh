#!/bin/bash
# Reference solution (oracle).
rm /workdir/cache.tmp
