#include "hub/model_ref.h"

namespace gemstage::hub {

namespace {

bool is_alnum(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

// One part of a repo id: 1-96 of [A-Za-z0-9_.-], starting and ending with a letter, digit or
// '_', no "--" or ".." (the second would also let a name climb out of the cache folder).
bool valid_repo_part(std::string_view s) {
  if (s.empty() || s.size() > 96) return false;
  for (char c : s)
    if (!is_alnum(c) && c != '_' && c != '-' && c != '.') return false;
  const auto word = [](char c) { return is_alnum(c) || c == '_'; };
  if (!word(s.front()) || !word(s.back())) return false;
  if (s.find("--") != std::string_view::npos || s.find("..") != std::string_view::npos)
    return false;
  if (s.size() >= 4 && s.substr(s.size() - 4) == ".git") return false;
  return true;
}

// A git ref name or commit: printable ASCII without the characters git refuses in ref names, no
// "..", no empty path component; it becomes a file name under refs/ in the cache, so these rules
// also keep it inside that folder.
bool valid_revision(std::string_view s) {
  if (s.empty() || s.size() > 255) return false;
  if (s.front() == '/' || s.back() == '/' || s.front() == '.' || s.front() == '-') return false;
  if (s.find("..") != std::string_view::npos || s.find("//") != std::string_view::npos ||
      s.find("/.") != std::string_view::npos || s.find("@{") != std::string_view::npos)
    return false;
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f) return false;
    if (c == '~' || c == '^' || c == ':' || c == '?' || c == '*' || c == '[' || c == '\\')
      return false;
  }
  return true;
}

}  // namespace

const std::string& ModelRef::revision_or_default() const {
  static const std::string main_branch = kDefaultRevision;
  return revision.empty() ? main_branch : revision;
}

std::string ModelRef::display() const {
  return revision.empty() ? repo_id() : repo_id() + "@" + revision;
}

std::optional<ModelRef> parse_model_ref(std::string_view text) {
  ModelRef r;
  const size_t at = text.find('@');
  std::string_view id = text.substr(0, at);
  if (at != std::string_view::npos) {
    const std::string_view rev = text.substr(at + 1);
    if (!valid_revision(rev)) return std::nullopt;
    r.revision = std::string(rev);
  }
  const size_t slash = id.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  const std::string_view org = id.substr(0, slash), name = id.substr(slash + 1);
  if (!valid_repo_part(org) || !valid_repo_part(name)) return std::nullopt;
  r.org = std::string(org);
  r.name = std::string(name);
  return r;
}

bool is_commit_hash(std::string_view revision) {
  if (revision.size() != 40) return false;
  for (char c : revision)
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  return true;
}

}  // namespace gemstage::hub
