# shellcheck shell=bash
# Environment bootstrap, sourced by scripts/test.sh and scripts/demo.sh:
#
#   source scripts/env.sh      # then run "$PY" ...
#
# Makes the virtualenv .venv in the repository root from the first working
# Python >= 3.12 among $MSA_PALLAS_PYTHON, python3.13, python3.12, python3,
# python and pyenv's installed versions; installs this package into it in
# editable mode with the extras in MSA_PALLAS_EXTRAS (default "test"); and
# exports the venv's python as PY. A working .venv is kept (a broken one is
# remade, and so is one on another Python than MSA_PALLAS_PYTHON when that is
# set). The install is skipped while .venv/.msa_pallas_stamp records the same
# pyproject.toml, Python, extras and repository path, so repeat runs are fast.
#
# Overrides:
#   MSA_PALLAS_PYTHON=/path/to/python3.12   the interpreter to build .venv from
#   MSA_PALLAS_EXTRAS=test,cuda             extras to install (e.g. on a GPU box)

export PIP_DISABLE_PIP_VERSION_CHECK=1

# Identity of an interpreter: its version and base installation. A venv
# reports the same as the Python it was made from.
_MSA_ID_CODE='import sys; print(sys.version.split()[0], sys.base_prefix)'

# Sets _msa_base to the first candidate that runs, is >= 3.12 and can make a
# venv: $MSA_PALLAS_PYTHON, python3.13, python3.12, python3, python, then
# pyenv's installed 3.12+ versions. Returns 1 with a message if none does.
_msa_find_python() {
    local c r p seen=""
    local -a candidates=() roots=() tried=()
    _msa_base=""
    if [ -n "${MSA_PALLAS_PYTHON:-}" ]; then
        candidates+=("$MSA_PALLAS_PYTHON")
    fi
    candidates+=(python3.13 python3.12 python3 python)
    if command -v pyenv >/dev/null 2>&1; then
        r="$(pyenv root 2>/dev/null)" && [ -n "$r" ] && roots+=("$r")
    fi
    roots+=("$HOME/.pyenv")
    for r in "${roots[@]}"; do
        case " $seen " in *" $r "*) continue ;; esac
        seen="$seen $r"
        for p in "$r"/versions/3.1[2-9]*/bin/python3; do
            [ -x "$p" ] && candidates+=("$p")
        done
    done

    for c in "${candidates[@]}"; do
        tried+=("$c")
        if "$c" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 12))' \
            >/dev/null 2>&1; then
            _msa_base="$c"
            return 0
        fi
        if [ "$c" = "${MSA_PALLAS_PYTHON:-}" ]; then
            echo "env.sh: MSA_PALLAS_PYTHON=$c is not a working Python >= 3.12" \
                "with venv; trying others." >&2
        fi
    done
    {
        echo "env.sh: no working Python >= 3.12 (with the venv module) found."
        echo "  tried: ${tried[*]}"
        echo "  Install Python 3.12 or 3.13 and point MSA_PALLAS_PYTHON at it, e.g."
        echo "    MSA_PALLAS_PYTHON=/usr/bin/python3.12 bash scripts/test.sh"
    } >&2
    return 1
}

_msa_env_main() {
    local root venv stamp extras want have="" base_id
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)" || return 1
    venv="$root/.venv"
    stamp="$venv/.msa_pallas_stamp"
    extras="${MSA_PALLAS_EXTRAS:-test}"

    # --- The virtualenv. -----------------------------------------------------
    # A working .venv on Python >= 3.12 is kept (no interpreter search), unless
    # MSA_PALLAS_PYTHON names a different Python; a broken one is remade.
    if [ -e "$venv" ]; then
        have="$("$venv/bin/python" -c 'import sys, importlib.util
if sys.version_info < (3, 12) or importlib.util.find_spec("pip") is None:
    sys.exit(1)
'"$_MSA_ID_CODE" 2>/dev/null)" || have=""
        if [ -z "$have" ]; then
            echo "env.sh: .venv is broken or too old; remaking it." >&2
            rm -rf "$venv"
        elif [ -n "${MSA_PALLAS_PYTHON:-}" ]; then
            base_id="$("$MSA_PALLAS_PYTHON" -c "$_MSA_ID_CODE" 2>/dev/null)" || base_id=""
            if [ -n "$base_id" ] && [ "$base_id" != "$have" ]; then
                echo "env.sh: .venv uses Python $have; remaking it with" \
                    "MSA_PALLAS_PYTHON=$MSA_PALLAS_PYTHON ($base_id)." >&2
                rm -rf "$venv"
                have=""
            fi
        fi
    fi
    if [ -z "$have" ]; then
        _msa_find_python || return 1
        have="$("$_msa_base" -c "$_MSA_ID_CODE" 2>/dev/null)" || return 1
        echo "env.sh: creating .venv with Python ${have%% *} ($_msa_base)" >&2
        if ! "$_msa_base" -m venv "$venv"; then
            echo "env.sh: '$_msa_base -m venv $venv' failed." >&2
            rm -rf "$venv"
            return 1
        fi
    fi

    # --- The package, installed once per (pyproject, Python, extras, path). --
    local pyproject_sum
    pyproject_sum="$("$venv/bin/python" -c 'import hashlib, sys
print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' \
        "$root/pyproject.toml")" || return 1
    want="pyproject-sha256=$pyproject_sum python=$have extras=$extras root=$root"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
        rm -f "$stamp"
        echo "env.sh: installing msa_pallas[$extras] into .venv" \
            "(about a minute on the first run)" >&2
        if ! (cd "$root" && "$venv/bin/python" -m pip install -q -e ".[$extras]"); then
            echo "env.sh: pip install -e '.[$extras]' failed (see above)." >&2
            return 1
        fi
        printf '%s\n' "$want" >"$stamp"
    fi

    PY="$venv/bin/python"
    export PY
}

if ! _msa_env_main; then
    unset -f _msa_env_main _msa_find_python
    unset _msa_base _MSA_ID_CODE
    # `return` when sourced, `exit` when run directly.
    return 1 2>/dev/null || exit 1
fi
unset -f _msa_env_main _msa_find_python
unset _msa_base _MSA_ID_CODE
