#!/bin/bash
# Reference solution (oracle).
cp /workdir/draft.md /workdir/final.md
