#include "stage/cache_files.h"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "core/error.h"
#include "io/file_writer.h"
#include "io/mapped_file.h"
#include "io/npy.h"

namespace gemstage {

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kFormat = "gemstage-kv-cache";
constexpr int kVersion = 1;
constexpr const char* kManifest = "kv_cache.json";

std::string layer_file(int layer, bool is_k) {
  return "layer_" + std::to_string(layer) + (is_k ? ".k.npy" : ".v.npy");
}

const char* kind_name(CacheKind k) {
  return k == CacheKind::Ring ? "ring" : "growing";
}

// The rows of positions first..n-1 of one side (K or V) of a layer, widened to f32.
std::vector<float> widened_rows(const LayerKvCache& c, bool is_k, int64_t first) {
  const int64_t rows = c.size() - first, w = c.width();
  std::vector<float> out(static_cast<size_t>(rows * w));
  for (int64_t r = 0; r < rows; ++r) c.widen(is_k, first + r, 0, w, out.data() + r * w);
  return out;
}

// A field of the manifest with the file named in every complaint.
template <typename T>
T field(const json& j, const char* name, const std::string& where) {
  if (!j.contains(name)) fail(where, ": missing field '", name, "'");
  try {
    return j.at(name).get<T>();
  } catch (const json::exception&) {
    fail(where, ": field '", name, "' has the wrong type");
  }
}

}  // namespace

void save_stage_cache(const Stage& stage, const KvCache& cache, const std::string& dir) {
  const StageDecl& d = stage.decl();
  if (d.role != StageRole::TransformerLayers)
    fail("stage '", d.id, "' is not a transformer stage; it keeps no KV cache");
  fs::create_directories(dir);
  json caches = json::array();
  for (int layer = d.layers.begin; layer < d.layers.end; ++layer) {
    const LayerKvCache* c = cache.own(layer);
    if (!c) continue;  // KV-shared: reads its donor's rows
    if (c->size() != cache.n_past())
      fail("stage '", d.id, "': layer ", layer, " holds ", c->size(), " positions but the group ",
           cache.n_past(), " (a call that did not complete)");
    const int64_t first = c->first_held();
    const Shape shape{c->size() - first, c->width()};
    for (const bool is_k : {true, false})
      save_npy_f32((fs::path(dir) / layer_file(layer, is_k)).string(), shape,
                   widened_rows(*c, is_k, first));
    caches.push_back({{"layer", layer},
                      {"kind", kind_name(c->kind())},
                      {"width", c->width()},
                      {"window", c->window()},
                      {"first_position", first}});
  }
  const json manifest = {{"format", kFormat},
                         {"version", kVersion},
                         {"stage", d.id},
                         {"layers", {d.layers.begin, d.layers.end}},
                         {"n_past", cache.n_past()},
                         {"kv_type", kv_type_name(cache.kv_type())},
                         {"caches", caches}};
  write_file_synced((fs::path(dir) / kManifest).string(), manifest.dump(2) + "\n");
}

std::unique_ptr<KvCache> load_stage_cache(const Stage& stage, const std::string& dir,
                                          int64_t max_context) {
  const StageDecl& d = stage.decl();
  const std::string where = (fs::path(dir) / kManifest).string();
  if (!fs::exists(where))
    fail(where,
         ": not found; --past takes a directory written by `dump --cache-out` or "
         "`run-stage --cache-out`");
  json m;
  try {
    m = json::parse(read_text_file(where, size_t{1} << 20));
  } catch (const json::exception& e) {
    fail(where, ": not JSON: ", e.what());
  }
  if (!m.is_object() || m.value("format", "") != kFormat)
    fail(where, ": not a gemstage KV cache (format is not \"", kFormat, "\")");
  if (field<int>(m, "version", where) != kVersion)
    fail(where, ": version ", m.at("version").dump(), " is not one this build reads (", kVersion,
         ")");
  const std::string id = field<std::string>(m, "stage", where);
  const auto layers = field<std::vector<int>>(m, "layers", where);
  if (id != d.id || layers != std::vector<int>{d.layers.begin, d.layers.end})
    fail(where, ": the cache of stage '", id, "' (layers ", m.at("layers").dump(),
         "), not of stage '", d.id, "' (layers [", d.layers.begin, ", ", d.layers.end, "])");
  KvType kv_type;
  const std::string type_name = field<std::string>(m, "kv_type", where);
  if (!kv_type_from_name(type_name, &kv_type))
    fail(where, ": kv_type '", type_name, "' is not f32, bf16 or q8_0");
  const int64_t n_past = field<int64_t>(m, "n_past", where);
  if (n_past < 0 || n_past >= max_context)
    fail(where, ": ", n_past, " saved positions leave no room in a context of ", max_context,
         " (raise --ctx-size / -c)");

  auto cache = stage.new_cache(max_context, kv_type);
  const json& entries = m.contains("caches") ? m.at("caches") : json();
  if (!entries.is_array()) fail(where, ": field 'caches' is missing or not an array");
  std::vector<bool> seen(static_cast<size_t>(d.layers.end), false);
  for (const json& e : entries) {
    const int layer = field<int>(e, "layer", where);
    LayerKvCache* c = layer >= d.layers.begin && layer < d.layers.end ? cache->own(layer) : nullptr;
    if (!c || seen[static_cast<size_t>(layer)])
      fail(where, ": layer ", layer, " is not a layer of stage '", d.id,
           "' that keeps its own cache, or is listed twice");
    seen[static_cast<size_t>(layer)] = true;
    if (field<std::string>(e, "kind", where) != kind_name(c->kind()) ||
        field<int64_t>(e, "width", where) != c->width() ||
        field<int64_t>(e, "window", where) != c->window())
      fail(where, ": layer ", layer, " was saved as ", e.dump(), " but this model's is a ",
           kind_name(c->kind()), " cache of width ", c->width(), " and window ", c->window());
    const int64_t first = field<int64_t>(e, "first_position", where);
    if (first > n_past || (c->kind() == CacheKind::Ring ? !c->start_at(first) : first != 0))
      fail(where, ": layer ", layer, ": first_position ", first, " is not one this cache can hold");
    std::vector<float> kv[2];
    for (const bool is_k : {true, false}) {
      const std::string path = (fs::path(dir) / layer_file(layer, is_k)).string();
      const NpyArray a = load_npy(path);
      const Shape want{n_past - first, c->width()};
      if (a.dtype != DType::F32 || a.shape != want)
        fail(path, ": expected float32 ", shape_str(want), " (positions ", first, "..", n_past - 1,
             "), found ", shape_str(a.shape));
      kv[is_k ? 0 : 1] = a.to_f32();
    }
    c->append(kv[0].data(), kv[1].data(), n_past - first);
    if (c->first_held() != first)
      fail(where, ": layer ", layer, ": ", n_past - first,
           " rows are more than this ring keeps; the file was not written by this model");
  }
  for (int layer = d.layers.begin; layer < d.layers.end; ++layer)
    if (cache->own(layer) && !seen[static_cast<size_t>(layer)])
      fail(where, ": layer ", layer, " of stage '", d.id, "' keeps a cache but none was saved");
  cache->advance(n_past);
  return cache;
}

}  // namespace gemstage
