#!/usr/bin/env bash
# mypy over the installed name, `shmgate` (configured in pyproject.toml). setup.py maps each top-level part
# (gateway/, worker/, ...) into `shmgate`; mypy follows no import hook, so it reads a view of that mapping
# made here under build/ (untracked, remade on every run): shmgate/'s own files and one link per part.
# Errors are printed with the checkout's own paths (gateway/app.py, not the view's).
set -euo pipefail
cd "$(dirname "$0")/.."
view=build/typecheck
rm -rf "$view"
mkdir -p "$view/shmgate"
cp shmgate/*.py "$view/shmgate/"
parts=$(.venv/bin/python -c 'import ast; t = ast.parse(open("setup.py").read()); print(" ".join(next(ast.literal_eval(n.value) for n in t.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PARTS")))')
for part in $parts; do
    ln -s "../../../$part" "$view/shmgate/$part"
done
status=0
.venv/bin/mypy "$view/shmgate" "$@" | sed "s|^$view/shmgate/\\(__init__\\|__main__\\)|shmgate/\\1|; s|^$view/shmgate/||" || status=${PIPESTATUS[0]}
exit "$status"
