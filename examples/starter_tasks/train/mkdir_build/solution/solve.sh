#!/bin/bash
# Reference solution (oracle).
mkdir /workdir/build
