#!/usr/bin/env bash
# An interpreter whose kubernetes client is another version than .venv's, for CI's Kubernetes
# stage on the lowest client major pytest-sky supports (pyproject.toml pins the range).
#
#   bash scripts/kube-client-venv.sh 30.1.0 .venv-kube30
#   .venv-kube30/bin/python -m pytest smoke --kubernetes ...
#
# A venv of its own holding only that client (its own dependencies pinned there as it asks)
# and pytest-sky, editable, for its console script; every other package comes from .venv,
# whose site-packages a .pth adds after its own, so the client found first is this one.
# Minutes of a second venv's torch install are saved; nothing is downloaded twice.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/kube-client-venv.sh VERSION DIR}
dir=${2:?usage: scripts/kube-client-venv.sh VERSION DIR}
main_site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
[ -x "$dir/bin/python" ] || .venv/bin/python -m venv --without-pip "$dir"
site=$("$dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf 'import site; site.addsitedir(%s)\n' "'$main_site'" >"$site/zz-pytest-sky-main-venv.pth"
# pip sees .venv's packages through the .pth: it installs here only what that client needs
# and .venv lacks or has in another version (google-auth for the older majors, say).
.venv/bin/python -m pip --python "$dir/bin/python" install -q "kubernetes==$version"
.venv/bin/python -m pip --python "$dir/bin/python" install -q --no-deps -e .
"$dir/bin/python" - "$version" <<'PY'
import sys

import kubernetes

assert kubernetes.__version__ == sys.argv[1], f"{kubernetes.__file__} is {kubernetes.__version__}"
PY
