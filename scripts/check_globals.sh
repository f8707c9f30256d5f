#!/usr/bin/env bash
# No process-wide mutable state (the project's rule): finds mutable namespace-scope variables,
# mutable static variables (in functions and classes) and thread_local variables in src/ and
# tools/, and fails on any that scripts/globals_allowlist.txt does not list. That file names the
# ones a rule's exception covers (state a signal handler reads, a lock around a library that is
# not thread-safe) and the ones being removed; an entry that no longer matches anything fails too,
# so the list stays true.
#   scripts/check_globals.sh            exit 0 when every finding is allowed
# A heuristic over the text, not a parser: it sees declarations written `T name = ...;`,
# `T name{...};` and `T name;` (at column 0 for namespace scope, anywhere after `static` or
# `thread_local`), skipping comments, raw string literals and anything declared const or
# constexpr. A variable constructed with parentheses (`static T name(args);`) looks like a
# function declaration and is not seen.
set -euo pipefail
cd "$(dirname "$0")/.."
allowlist=scripts/globals_allowlist.txt

findings=$(find src tools -name '*.cc' -o -name '*.h' | LC_ALL=C sort | xargs awk '
  FNR == 1 { raw = "" }
  {
    line = $0
    # Inside a raw string literal R"delim( ... )delim": skip to its end.
    if (raw != "") {
      at = index(line, ")" raw "\"")
      if (at == 0) next
      line = substr(line, at + length(raw) + 2)
      raw = ""
    }
    if (match(line, /R"[^(]*\(/)) {
      delim = substr(line, RSTART + 2, RLENGTH - 3)
      rest = substr(line, RSTART + RLENGTH)
      if (index(rest, ")" delim "\"") == 0) raw = delim
      line = substr(line, 1, RSTART - 1)
    }
    sub(/\/\/.*/, "", line)
    text = line
    gsub(/^[ \t]+|[ \t]+$/, "", text)
    if (text == "") next
    # A declaration of one or more variables: a type, then a name, then = { ; , or [.
    decl = "^[A-Za-z_][A-Za-z0-9_:<>, *&]*[ *&]+[A-Za-z_][A-Za-z0-9_]*[ \t]*(\\[[^]]*\\])?[ \t]*(=|\\{|;|,)"
    # const or constexpr as the leading qualifier, or const right before the name (T* const p).
    is_const = text ~ /^((static|inline|extern|thread_local)[ \t]+)*(const|constexpr|constinit)[ \t]/ ||
               text ~ /[ \t*&]const[ \t]+[A-Za-z_][A-Za-z0-9_]*[ \t]*(\[[^]]*\])?[ \t]*(=|\{|;)/
    kind = ""
    if (text ~ /(^|[ \t])thread_local[ \t]/) {
      kind = "thread_local"
    } else if (text ~ /^(inline[ \t]+)?static[ \t]/) {
      body = text
      sub(/^(inline[ \t]+)?static[ \t]+/, "", body)
      if (body ~ decl && body !~ /^[^=({]*\(/) kind = "static"
    } else if (line ~ /^[A-Za-z_]/ && text ~ decl && text !~ /^[^=({]*\(/ &&
               text !~ /^(using|typedef|namespace|class|struct|union|enum|template|return|friend|extern|__extension__|case|goto|delete|new|else|do)[ \t]/) {
      kind = "namespace-scope"
    }
    if (kind != "" && !is_const) print FILENAME ": " text "\t" FNR "\t" kind
  }')

status=0
allowed=$(grep -v '^[[:space:]]*\(#\|$\)' "$allowlist" || true)
while IFS=$'\t' read -r key line kind; do
  [[ -z "$key" ]] && continue
  if ! grep -qxF -- "$key" <<<"$allowed"; then
    echo "check_globals: ${key%%: *}:$line: mutable $kind state: ${key#*: }" >&2
    status=1
  fi
done <<<"$findings"
keys=$(cut -f1 <<<"$findings")
while IFS= read -r entry; do
  [[ -z "$entry" ]] && continue
  if ! grep -qxF -- "$entry" <<<"$keys"; then
    echo "check_globals: $allowlist lists '$entry', which is no longer in the tree: remove the entry" >&2
    status=1
  fi
done <<<"$allowed"
if ((status)); then
  echo "check_globals: process-wide mutable state is not allowed (the project's standards); pass the" \
       "state in, or, where a signal handler or a library that is not thread-safe needs it, list" \
       "it in $allowlist with the reason" >&2
else
  echo "check_globals: $(grep -c . <<<"$keys") allowed finding(s), nothing new"
fi
exit "$status"
