#!/bin/bash
# Reference solution (oracle).
touch /workdir/done.flag
