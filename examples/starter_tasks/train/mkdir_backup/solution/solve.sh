#!/bin/bash
# Reference solution (oracle).
mkdir /workdir/backup
