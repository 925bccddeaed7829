#!/bin/sh
# A rank for `ftrun --no_python`: records its environment contract and arguments in OUT_DIR.
out="$1"
shift
echo "shell rank $RANK of $WORLD_SIZE args: $*"
printf '%s %s %s %s\n' "$RANK" "$LOCAL_RANK" "$WORLD_SIZE" "$*" > "$out/sh_$RANK.tmp"
mv "$out/sh_$RANK.tmp" "$out/sh_$RANK.txt"
