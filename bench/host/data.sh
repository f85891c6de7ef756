#!/usr/bin/env bash
# Tokenizing on a cache miss: one process against 4, 8 and 16 worker processes (the machine's CPUs).
source "$(dirname "$0")/../common.sh"
step data_prep 400 python3 bench/host/data_prep.py --conversations 6000 --workers 1,4,8,16
finish
