#!/usr/bin/env bash
# Apply megatron-lm-pretrain_gpt.patch to MEGATRON_LM_DIR/pretrain_gpt.py, all or nothing.
#
# Dry-runs first; when a hunk does not apply it names the lines it looked for and leaves the
# file untouched. The patched text is written to a staging copy and moved over the original,
# so neither a half-patched file nor .orig/.rej files are left behind.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
patch_file="$here/megatron-lm-pretrain_gpt.patch"
# Megatron-LM versions (megatron/core/package_info.py of the checkout) whose training runs with the patch:
# core_v0.16.x to core_v0.19.x and main as of 2026-08 (0.20.0 pre-release); see docs/compatibility.md.
min_version="0.16.0"
above="0.21.0"  # first version not supported
versions="Megatron-LM core_v0.16.0 .. core_v0.19.x and main up to 2026-08 (megatron-core $min_version up to, not including, $above)"
marker="# megatron-zb"
# One line per hunk; their presence means the patch is in.
applied_lines=("megatron_zb.install()" "megatron_zb.extra_args_provider(")

usage() {
    echo "usage: bash patches/apply.sh MEGATRON_LM_DIR" >&2
    echo "  patches MEGATRON_LM_DIR/pretrain_gpt.py for megatron-zb (install(), our flags, early flag checks)" >&2
}

if [[ $# -ne 1 ]]; then
    usage
    exit 2
fi
checkout="$1"
target="$checkout/pretrain_gpt.py"
if [[ ! -f "$target" ]]; then
    echo "apply.sh: $target does not exist" >&2
    usage
    exit 2
fi

# MAJOR.MINOR.PATCH of the checkout's megatron-core, or nothing when package_info.py is missing.
checkout_version() {
    local info="$checkout/megatron/core/package_info.py"
    [[ -f "$info" ]] || return 0
    local major minor patch
    major=$(sed -nE 's/^MAJOR *= *([0-9]+).*/\1/p' "$info")
    minor=$(sed -nE 's/^MINOR *= *([0-9]+).*/\1/p' "$info")
    patch=$(sed -nE 's/^PATCH *= *([0-9]+).*/\1/p' "$info")
    [[ -n "$major" && -n "$minor" && -n "$patch" ]] && echo "$major.$minor.$patch"
}

instead() {
    cat >&2 <<EOF
This patch is for $versions.
Instead:
  - add the lines by hand in the __main__ block of $target, before pretrain() is called:
        import megatron_zb  $marker
        megatron_zb.install()  $marker
        megatron_zb.check_flags_before_init()  $marker
    and wrap what the script passes as pretrain()'s extra_args_provider (None if nothing):
        extra_args_provider=megatron_zb.extra_args_provider(<what it passed>),  $marker
  - or leave $target alone and run Megatron-LM's pretrain() through megatron-zb:
        MEGATRON_LM_PATH=$checkout torchrun ... -m megatron_zb.pretrain_gpt --megatron-lm <flags>
EOF
}

version=$(checkout_version)
if [[ -z "$version" ]]; then
    echo "apply.sh: cannot tell the Megatron-LM version of $checkout ($checkout/megatron/core/package_info.py" \
        "has no MAJOR/MINOR/PATCH); this patch is for $versions. $target was not changed." >&2
    exit 1
fi
version_le() { [[ "$(printf '%s\n%s\n' "$1" "$2" | sort -V | head -n1)" == "$1" ]]; }
if ! version_le "$min_version" "$version" || version_le "$above" "$version"; then
    echo "apply.sh: $checkout is Megatron-LM (megatron-core) $version; this patch is for $versions." >&2
    echo "Training on other versions was not checked: $target was not changed." >&2
    echo "Use a checkout in that range (e.g. git -C $checkout checkout core_v0.19.0)." >&2
    exit 1
fi

found=()
for line in "${applied_lines[@]}"; do
    if grep -qF -- "$line" "$target"; then
        found+=("$line")
    fi
done
if [[ ${#found[@]} -eq ${#applied_lines[@]} ]]; then
    echo "apply.sh: already applied to $target (found the \"$marker\" lines); nothing to do"
    exit 0
fi
if [[ ${#found[@]} -gt 0 ]]; then
    echo "apply.sh: $target is partly patched: it has '${found[*]}' but not all of '${applied_lines[*]}'." >&2
    echo "Restore the original (e.g. git -C $checkout checkout pretrain_gpt.py) and run this again." >&2
    exit 1
fi

# The lines hunk N needs to find (context and removed lines), indented.
expected_lines() {
    awk -v n="$1" '
        /^@@/ { hunk++; next }
        hunk == n && /^[ -]/ { print "        " substr($0, 2) }
    ' "$patch_file"
}

if ! command -v patch >/dev/null; then
    echo "apply.sh: needs GNU patch (e.g. apt-get install patch); $target was not changed" >&2
    exit 1
fi
patch_options=(--batch --forward --fuzz=1 --no-backup-if-mismatch --reject-file=-)
if ! report=$(patch --dry-run "${patch_options[@]}" "$target" -i "$patch_file" 2>&1); then
    echo "apply.sh: the patch does not apply to $target; the file was not changed." >&2
    failed=$(grep -oE 'Hunk #[0-9]+ FAILED' <<<"$report" | grep -oE '[0-9]+' || true)
    if [[ -z "$failed" ]]; then
        echo "$report" >&2
    fi
    for hunk in $failed; do
        echo "Hunk $hunk found no place with these lines (in this order):" >&2
        expected_lines "$hunk" >&2
    done
    instead
    exit 1
fi

staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
cp -p "$target" "$staging/pretrain_gpt.py"
patch --silent "${patch_options[@]}" "$staging/pretrain_gpt.py" -i "$patch_file"
if command -v python3 >/dev/null \
    && ! python3 -c 'import ast, sys; ast.parse(open(sys.argv[1]).read(), sys.argv[1])' "$staging/pretrain_gpt.py"; then
    echo "apply.sh: the patched text does not parse as Python; $target was not changed" >&2
    instead
    exit 1
fi
# Same directory as the target, so the final mv is a rename.
replacement="$target.megatron-zb.tmp"
trap 'rm -rf "$staging" "$replacement"' EXIT
cp -p "$staging/pretrain_gpt.py" "$replacement"
mv -f "$replacement" "$target"
echo "apply.sh: patched $target (lines marked \"$marker\"); launch it with --enable-zero-bubble or --pipeline-schedule NAME"
