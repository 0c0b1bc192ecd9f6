#!/usr/bin/env bash
# CI's last leg, on the newest JAX the project supports (0.12.x, which needs Python >= 3.12) and
# the newest Python, 3.13: what a JAX version can break. The tests marked `newest_jax` (the Triton
# compile-to-ISA tests of every kernel form on gfx942 / gfx950 / sm_90, spill detection, the
# engine's steps traced for GPU platforms, multi-host), then the default and heavy tests of the files whose subject is JAX's
# own API surface (COMPAT_FILES: lowering to GPU platforms, KV pages, sharding and collectives,
# Orbax checkpoints). The behaviour suite
# (the engine, scheduler, speculation, serving, scripts, benchmarks) runs on JAX 0.10 in the first
# legs only: XLA:CPU of jaxlib 0.12 compiles the tests' programs about 1.6x slower (0.10 has the
# elemental-emitter switch, conftest.py), and running that suite twice took CI past its 45 minutes;
# the engine still runs here through the multi-host tests. Triton's interpreter runs on torch CPU
# tensors, so the kernels through the engine and the GPU check script run in the heavy leg. Those marked `slow`
# (longer variants of cases that default or newest_jax tests run) are left to `python -m pytest -m
# slow`. The local CPU torch build is for Python 3.11 only, so torch / transformers are left out and
# the tests that compare against them, or interpret the kernels, skip.
#
# Python: a working python3.13 (else 3.12) on PATH or under pyenv, else CPython 3.13 built from
# Debian's trixie source package (the same Debian registry as the system's, a deb-src line for
# trixie; about 5 minutes on 2 cores). The build and the leg's virtual environment are cached
# outside the clone (under $XDG_CACHE_HOME or ~/.cache), so reruns on the same machine skip them.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cache="${XDG_CACHE_HOME:-$HOME/.cache}/eagle3-jax"
mkdir -p "$cache"

works() { "$1" -c 'import sys, ssl, venv; assert sys.version_info >= (3, 12)' 2>/dev/null; }

find_python() {
    local candidate
    for candidate in python3.13 "$HOME"/.pyenv/versions/3.13*/bin/python3.13 "$cache/python3.13/bin/python3.13" \
                     python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        if works "$candidate"; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

build_python() {
    # Debian's python3.13 source package, from the registry the system's apt sources already name.
    local uri src work
    uri=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
    if [ -z "$uri" ]; then
        uri=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null || true)
    fi
    [ -n "$uri" ] || { echo "newest_jax.sh: no Debian apt source found to fetch python3.13's source from" >&2; exit 1; }
    src=/etc/apt/sources.list.d/eagle3-jax-trixie-src.sources
    printf 'Types: deb-src\nURIs: %s\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
        "$uri" > "$src"
    apt-get update -qq -o Dir::Etc::sourcelist="$src" -o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0
    work=$(mktemp -d)
    log="$cache/python3.13-build.log"
    if ! (cd "$work" && apt-get source -qq --download-only python3.13 && rm -f "$src" \
            && dpkg-source -x --skip-patches python3.13_*.dsc src \
            && cd src && ./configure --prefix="$cache/python3.13" --without-ensurepip \
            && make -j"$(nproc)" && make install) > "$log" 2>&1; then
        tail -20 "$log" >&2
        echo "newest_jax.sh: building CPython 3.13 failed; the whole log is $log" >&2
        exit 1
    fi
    rm -rf "$work"
}

start=$(date +%s)
python=$(find_python || true)
if [ -z "$python" ]; then
    echo "newest_jax.sh: no Python >= 3.12 here; building CPython 3.13 from Debian's source into $cache/python3.13"
    build_python
    python=$(find_python)
fi

venv="$cache/venv-newest-jax"
stamp="$venv/.stamp-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$stamp" ]; then
    rm -rf "$venv"
    "$python" -m venv --without-pip "$venv"
    wheels=$(mktemp -d)
    if "$python" -m pip --version >/dev/null 2>&1; then
        "$python" -m pip download -q --no-deps -d "$wheels" pip
    else
        python3 -m pip download -q --no-deps -d "$wheels" pip  # the system Python's pip fetches pip's wheel
    fi
    "$venv/bin/python" "$(ls "$wheels"/pip-*.whl)/pip" install -q --no-index "$(ls "$wheels"/pip-*.whl)"
    rm -rf "$wheels"
    # the project with every extra at the newest JAX it allows, plus the test tools (no torch / transformers)
    "$venv/bin/pip" install -q -e '.[test-notorch]' "jax>=0.12,<0.13" "jaxlib>=0.12,<0.13"
    touch "$stamp"
else
    "$venv/bin/pip" install -q --no-deps -e .  # this clone, not the one the cache was made from
fi
"$venv/bin/python" -c 'import sys, jax; print(f"newest-JAX leg: Python {sys.version.split()[0]}, jax {jax.__version__}")'
if [ "${1:-}" = "--prepare" ]; then  # the Python and the environment only (.ci/run builds them beside the first leg)
    echo "newest-JAX leg prepared: $(( $(date +%s) - start )) s"
    exit 0
fi

COMPAT_FILES=(tests/test_{lowering,spec_lowering,kv_cache,checkpoint,sharding}.py)
export XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
pytest=("$venv/bin/python" -m pytest -q -n 2 --dist loadfile -p no:cacheprovider)
# -m lifts pyproject's default deselection of `newest_jax`
"${pytest[@]}" -m "newest_jax and not slow" tests/
"${pytest[@]}" -m "not slow and not newest_jax" "${COMPAT_FILES[@]}"  # their heavy tests too
echo "newest-JAX leg: $(( $(date +%s) - start )) s"
