#!/bin/bash
# Reference solution (oracle).
rm /workdir/old.log
