#include "stage/partition.h"

#include <algorithm>
#include <cmath>
#include <sstream>

#include "core/error.h"

namespace gemstage {

namespace {
std::string cuts_str(const std::vector<int>& cuts) {
  if (cuts.empty()) return "(none: the model must stay in one transformer stage)";
  // Compress runs: 1..13 reads better than 13 numbers.
  std::ostringstream os;
  for (size_t i = 0; i < cuts.size();) {
    size_t j = i;
    while (j + 1 < cuts.size() && cuts[j + 1] == cuts[j] + 1) ++j;
    os << (i ? ", " : "") << cuts[i];
    if (j > i) os << (j == i + 1 ? ", " : "..") << cuts[j];
    i = j + 1;
  }
  return os.str();
}
}  // namespace

std::vector<int> valid_cut_points(const TextConfig& t) {
  std::vector<int> cuts;
  const int L = t.num_hidden_layers;
  for (int c = 1; c < L; ++c) {
    bool ok = true;
    for (int i = 0; i < L && ok; ++i) {
      const LayerSpec& s = t.layers[static_cast<size_t>(i)];
      if (s.kv_shared && ((s.kv_donor < c) != (i < c))) ok = false;
    }
    if (ok) cuts.push_back(c);
  }
  return cuts;
}

void validate_stage_ranges(const std::vector<LayerRange>& ranges, const TextConfig& t) {
  const int L = t.num_hidden_layers;
  if (ranges.empty()) fail("--stages: no layer ranges given");
  int expect = 0;
  for (const LayerRange& r : ranges) {
    if (r.begin >= r.end) fail("--stages: range ", r.str(), " is empty or reversed");
    if (r.begin != expect) {
      if (r.begin < expect)
        fail("--stages: range ", r.str(), " overlaps the previous range (layers from ", r.begin,
             " to ", expect - 1, " would run twice)");
      fail("--stages: layers ", expect, " to ", r.begin - 1,
           " are not in any range; ranges must cover [0, ", L, ") exactly once, in order");
    }
    expect = r.end;
  }
  if (expect != L)
    fail("--stages: the ranges end at layer ", expect, " but the model has ", L,
         " layers; the last range must end at ", L);
  for (size_t k = 0; k < ranges.size(); ++k)
    for (int i = ranges[k].begin; i < ranges[k].end; ++i) {
      const LayerSpec& s = t.layers[static_cast<size_t>(i)];
      if (s.kv_shared && (s.kv_donor < ranges[k].begin || s.kv_donor >= ranges[k].end))
        fail("--stages: layer ", i, " (KV-shared, ", layer_type_name(s.type),
             ") reads the K/V of layer ", s.kv_donor, ", which the split ", ranges[k].str(),
             " puts in another stage; valid cut points for this model are ",
             cuts_str(valid_cut_points(t)));
    }
}

double layer_parameters(const TextConfig& t, int layer) {
  const LayerSpec& s = t.layers.at(static_cast<size_t>(layer));
  const double D = t.hidden_size, q = static_cast<double>(t.num_attention_heads) * s.head_dim,
               kv = static_cast<double>(s.num_kv_heads) * s.head_dim;
  double p = 2 * q * D;                                // q_proj, o_proj
  if (!s.kv_shared) p += (s.k_eq_v ? 1 : 2) * kv * D;  // k_proj (and v_proj)
  p += 3.0 * s.mlp_width * D;                          // gate, up, down
  if (s.moe)
    p += static_cast<double>(t.num_experts) *
         (3.0 * t.moe_intermediate_size * D + D);  // experts, router
  if (t.has_ple()) p += 2.0 * t.ple_dim() * D;
  return p;
}

std::vector<LayerRange> parse_stage_spec(const std::string& spec, const TextConfig& t) {
  const int L = t.num_hidden_layers;
  std::vector<LayerRange> ranges;
  if (spec.find(':') == std::string::npos) {
    int n = 0;
    try {
      size_t used = 0;
      n = std::stoi(spec, &used);
      if (used != spec.size()) n = 0;
    } catch (...) {
      n = 0;
    }
    if (n <= 0)
      fail("--stages must be ranges like 0:21,21:42 or a stage count like 2; got '", spec, "'");
    const std::vector<int> cuts = valid_cut_points(t);
    if (n - 1 > static_cast<int>(cuts.size()))
      fail("--stages ", n, ": this model has only ", cuts.size(), " valid cut points (",
           cuts_str(cuts), "), so at most ", cuts.size() + 1, " transformer stages");
    // Balanced by weight bytes: for each ideal boundary (k/n of the layers' parameters) take the
    // valid cut whose cumulative share is nearest. An MoE layer holds many times a dense
    // layer's weights, and a full layer more than a sliding one.
    std::vector<double> before(static_cast<size_t>(L) + 1, 0.0);  // parameters of layers [0, i)
    for (int i = 0; i < L; ++i)
      before[static_cast<size_t>(i) + 1] = before[static_cast<size_t>(i)] + layer_parameters(t, i);
    std::vector<int> chosen;
    int prev = 0;
    for (int k = 1; k < n; ++k) {
      const double ideal = before.back() * k / n;
      int best = -1;
      for (int c : cuts) {
        if (c <= prev) continue;
        const int remaining_cuts =
            static_cast<int>(std::count_if(cuts.begin(), cuts.end(), [&](int x) { return x > c; }));
        if (remaining_cuts < n - 1 - k) continue;
        if (best < 0 || std::fabs(before[static_cast<size_t>(c)] - ideal) <
                            std::fabs(before[static_cast<size_t>(best)] - ideal))
          best = c;
      }
      if (best < 0)
        fail("--stages ", n, ": cannot place ", n - 1, " cuts at valid points (", cuts_str(cuts),
             ")");
      chosen.push_back(best);
      prev = best;
    }
    int b = 0;
    for (int c : chosen) {
      ranges.push_back({b, c});
      b = c;
    }
    ranges.push_back({b, L});
  } else {
    std::stringstream ss(spec);
    std::string part;
    while (std::getline(ss, part, ',')) {
      const size_t colon = part.find(':');
      if (colon == std::string::npos) fail("--stages: '", part, "' is not a range like 0:21");
      try {
        size_t u1 = 0, u2 = 0;
        const std::string a = part.substr(0, colon), b = part.substr(colon + 1);
        const int x = std::stoi(a, &u1), y = std::stoi(b, &u2);
        if (u1 != a.size() || u2 != b.size()) throw std::invalid_argument("trailing");
        ranges.push_back({x, y});
      } catch (const std::exception&) {
        fail("--stages: '", part, "' is not a range of two integers like 0:21");
      }
    }
  }
  validate_stage_ranges(ranges, t);
  return ranges;
}

}  // namespace gemstage
