#!/usr/bin/env bash
# make install: requirements.txt into the venv at $1 with uv, or with pip where uv cannot (no uv wheel, a resolve
# that fails). uv reads no pip.conf: pip's configured indexes, wheel folders, constraints and certificates are handed
# to it, with pip's rule of taking the best version from any index (unsafe-best-match).
set -uo pipefail
py=$1/bin/python
"$py" -m pip install -q --upgrade pip
if "$py" -m pip install -q uv; then
    args=()
    while IFS='=' read -r key value; do
        value=${value#\'} value=${value%\'}
        for v in $value; do
            case ${key##*.} in
                index-url) args+=(--index-url "$v") ;;
                extra-index-url) args+=(--extra-index-url "$v") ;;
                find-links) args+=(--find-links "$v") ;;
                constraint) args+=(--constraint "$v") ;;
                cert) export SSL_CERT_FILE="$v" ;;
            esac
        done
    done < <("$py" -m pip config list 2>/dev/null)
    "$py" -m uv pip install --quiet --compile-bytecode --python "$py" --index-strategy unsafe-best-match "${args[@]}" -r requirements.txt &&
        exit 0
    echo "install: uv could not install requirements.txt; installing with pip" >&2
fi
exec "$py" -m pip install -q -r requirements.txt
