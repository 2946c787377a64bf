#!/bin/bash
# Reference solution (oracle).
cp /workdir/config.ini /workdir/config.bak
