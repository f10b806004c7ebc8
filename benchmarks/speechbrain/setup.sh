#!/usr/bin/env bash
# SpeechBrain 1.1.2, side by side with our BEST-RQ: a separate virtual environment (never a
# dependency of this repository) plus SpeechBrain's own BEST-RQ recipe folder, run from its checkout.
#
#   bash benchmarks/speechbrain/setup.sh                      # clones github.com/speechbrain/speechbrain at v1.1.2
#   bash benchmarks/speechbrain/setup.sh --repo PATH [--ref REF]  # an existing checkout or (bare) git dir
#
# Creates (both git-ignored):
#   benchmarks/speechbrain/.venv/     speechbrain==1.1.2 + the torch/torchaudio pins of requirements.txt
#   benchmarks/speechbrain/.sb_repo/  SpeechBrain's recipes/LibriSpeech/self-supervised-learning/BEST-RQ/
#                                     and recipes/LibriSpeech/ASR/CTC/ at REF, and SOURCE.txt saying
#                                     which commit they came from
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
sb_version="1.1.2"
ref="v$sb_version"
repo=""
python="${PYTHON:-python3}"
recipe="recipes/LibriSpeech/self-supervised-learning/BEST-RQ"
ctc_recipe="recipes/LibriSpeech/ASR/CTC"  # benchmarks/peers/: their from-scratch Conformer-CTC

while [[ $# -gt 0 ]]; do
  case "$1" in
    --repo) repo="${2:?--repo needs a path}"; shift 2 ;;
    --ref) ref="${2:?--ref needs a tag or commit}"; shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument '$1' (use --repo PATH, --ref REF)" >&2; exit 2 ;;
  esac
done

die() { echo "setup.sh: $*" >&2; exit 1; }

# The same torch/torchaudio as our side, read from requirements.txt so the two never drift apart.
torch_pin="$(grep -E '^torch==' "$root/requirements.txt" || true)"
torchaudio_pin="$(grep -E '^torchaudio==' "$root/requirements.txt" || true)"
[[ -n "$torch_pin" && -n "$torchaudio_pin" ]] \
  || die "no 'torch==' / 'torchaudio==' pin in $root/requirements.txt; pin both there first"
command -v "$python" >/dev/null || die "no '$python' on PATH; set PYTHON=/path/to/python3"

# ---- SpeechBrain's recipe folder at REF --------------------------------------------------------
dest="$here/.sb_repo"
tmp="$here/.sb_repo.tmp"
rm -rf "$tmp"; mkdir -p "$tmp"
if [[ -z "$repo" ]]; then
  command -v git >/dev/null || die "git is not installed; install git or pass --repo PATH to a checkout"
  git clone --quiet --depth 1 --branch "$ref" https://github.com/speechbrain/speechbrain "$tmp/clone" \
    || die "could not clone speechbrain at $ref from GitHub; pass --repo PATH to an existing checkout"
  gitdir="$tmp/clone/.git"
else
  [[ -d "$repo" ]] || die "--repo $repo is not a directory; give a SpeechBrain checkout or git dir"
  gitdir="$(git -C "$repo" rev-parse --absolute-git-dir 2>/dev/null)" \
    || die "--repo $repo is not a git repository; give a SpeechBrain checkout or git dir"
fi
commit="$(git --git-dir "$gitdir" rev-parse --verify --quiet "$ref^{commit}")" \
  || die "$ref is not in $repo (newest tags there: $(git --git-dir "$gitdir" tag --sort=-creatordate | head -3 | tr '\n' ' ')); pass --ref with one that exists"
git --git-dir "$gitdir" cat-file -e "$commit:$recipe/train.py" 2>/dev/null \
  || die "$ref has no $recipe/train.py; pass a --ref from SpeechBrain 1.1 or newer"
# librispeech_prepare.py in the recipe folder is a symlink to ../../librispeech_prepare.py: export both.
git --git-dir "$gitdir" archive "$commit" "$recipe" "$ctc_recipe" "recipes/LibriSpeech/librispeech_prepare.py" | tar -x -C "$tmp"
repo_version="$(git --git-dir "$gitdir" show "$commit:speechbrain/version.txt" 2>/dev/null || echo unknown)"
{
  echo "ref: $ref"
  echo "commit: $commit"
  echo "repository version.txt: $repo_version"
  echo "installed package: speechbrain==$sb_version"
  echo "from: ${repo:-https://github.com/speechbrain/speechbrain}"
} > "$tmp/SOURCE.txt"
[[ -f "$tmp/$recipe/librispeech_prepare.py" ]] || die "$ref: $recipe/librispeech_prepare.py does not resolve; pass another --ref"
rm -rf "$tmp/clone" "$dest"
mv "$tmp" "$dest"
if [[ "$repo_version" != "$sb_version" ]]; then
  echo "setup.sh: note: the recipe comes from $ref ($commit, version.txt $repo_version), the package is $sb_version" >&2
fi

# ---- the separate environment ------------------------------------------------------------------
venv="$here/.venv"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
"$venv/bin/python" -m pip install --quiet "speechbrain==$sb_version" "$torch_pin" "$torchaudio_pin"
"$venv/bin/python" - "$sb_version" <<'PY'
import sys, speechbrain, torch, torchaudio
if speechbrain.__version__ != sys.argv[1]:
    sys.exit(f"setup.sh: speechbrain {speechbrain.__version__} installed, {sys.argv[1]} wanted; re-run setup.sh")
print(f"speechbrain {speechbrain.__version__}, torch {torch.__version__}, torchaudio {torchaudio.__version__}")
PY
echo "recipe: $dest/$recipe  ($(sed -n 2p "$dest/SOURCE.txt"))"
