#include "parity/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <vector>

namespace gemstage {

using nlohmann::json;

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string num(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.2f", v);
  return b;
}

// The last two components of a path ("gemma4-tiny/model"): enough to tell runs apart.
std::string short_path(std::string p) {
  while (p.size() > 1 && p.back() == '/') p.pop_back();
  const std::filesystem::path fp(p);
  const std::string parent = fp.parent_path().filename().string();
  return parent.empty() ? fp.filename().string() : parent + "/" + fp.filename().string();
}

struct Series {
  std::string label, color, dash, marker;  // marker: circle | square
  std::vector<double> cos, max_abs;        // per layer (NaN: absent)
};

// Per-layer values of one row class of a tap (or of all rows when cls is empty).
bool layer_series(const json& taps, const std::string& tap, const std::string& cls, Series& s) {
  if (!taps.contains(tap) || !taps[tap].contains("layers")) return false;
  bool any = false;
  for (const json& l : taps[tap]["layers"]) {
    const json* st = &l;
    if (!cls.empty()) {
      if (!l.contains("classes") || !l["classes"].contains(cls)) {
        s.cos.push_back(NAN);
        s.max_abs.push_back(NAN);
        continue;
      }
      st = &l["classes"][cls];
    }
    s.cos.push_back((*st)["cos_min"].get<double>());
    s.max_abs.push_back((*st)["max_abs"].get<double>());
    any = true;
  }
  return any;
}

}  // namespace

std::string render_parity_svg(const json& r) {
  const json& taps = r["taps"];
  std::vector<Series> series;
  const std::string blue = "#1f77b4", orange = "#e8590c", gray = "#6c757d";
  struct Want {
    std::string tap, cls, label, color, dash, marker;
  };
  const std::vector<Want> wants = {
      {"hidden_states", "text", "hidden_states, text rows", blue, "", "circle"},
      {"hidden_states", "image", "hidden_states, image rows", orange, "", "square"},
      {"hidden_states", "special", "hidden_states, special rows", gray, "", "circle"},
      {"per_layer_inputs", "text", "per_layer_inputs, text rows", blue, "6,4", "circle"},
      {"per_layer_inputs", "image", "per_layer_inputs, image rows", orange, "6,4", "square"},
  };
  for (const Want& w : wants) {
    Series s{w.label, w.color, w.dash, w.marker, {}, {}};
    if (layer_series(taps, w.tap, w.cls, s)) series.push_back(s);
  }
  size_t L = 0;
  for (const Series& s : series) L = std::max(L, s.cos.size());

  // Layout.
  const double W = 900, H = 700, left = 80, right = 640, top1 = 80, bot1 = 330, top2 = 400,
               bot2 = 640;
  auto xat = [&](size_t l) {
    return L <= 1 ? (left + right) / 2
                  : left + 20 +
                        (right - left - 40) * static_cast<double>(l) / static_cast<double>(L - 1);
  };
  // Cosine axis: from a little below the lowest value (at least 0.99) to 1.
  double cmin = 1.0;
  for (const Series& s : series)
    for (double v : s.cos)
      if (std::isfinite(v)) cmin = std::min(cmin, v);
  double c_lo = std::min(0.99, cmin - 0.1 * (1.0 - cmin));
  c_lo = std::max(-1.0, c_lo);
  const double c_hi = 1.0 + (1.0 - c_lo) * 0.03;
  auto ycos = [&](double v) { return bot1 - (bot1 - top1) * (v - c_lo) / (c_hi - c_lo); };
  // Max-abs axis: decades covering every non-zero value and the tolerances.
  std::vector<double> tols;
  for (const char* t : {"hidden_states", "per_layer_inputs"})
    if (taps.contains(t) && taps[t]["tolerance"].is_number())
      tols.push_back(taps[t]["tolerance"].get<double>());
  double mmin = 1e300, mmax = 0;
  for (const Series& s : series)
    for (double v : s.max_abs)
      if (std::isfinite(v) && v > 0) {
        mmin = std::min(mmin, v);
        mmax = std::max(mmax, v);
      }
  for (double t : tols) {
    mmin = std::min(mmin, t);
    mmax = std::max(mmax, t);
  }
  if (mmax <= 0) {
    mmin = 1e-8;
    mmax = 1;
  }
  const double d_lo = std::floor(std::log10(mmin)) - (mmin == mmax ? 1 : 0),
               d_hi = std::max(std::ceil(std::log10(mmax)), d_lo + 1);
  const double floor_v = std::pow(10.0, d_lo);
  auto ylog = [&](double v) {
    const double lv = std::log10(std::max(v, floor_v));
    return bot2 - (bot2 - top2) * (lv - d_lo) / (d_hi - d_lo);
  };

  std::ostringstream o;
  o << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    << "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"" << W << "\" height=\""
    << H << "\" viewBox=\"0 0 " << W << " " << H
    << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
    << "<rect x=\"0\" y=\"0\" width=\"" << W << "\" height=\"" << H << "\" fill=\"#ffffff\"/>\n";
  const std::string model = short_path(r.value("model", ""));
  const std::string refname = short_path(r.value("reference", ""));
  o << "<text x=\"" << left << "\" y=\"28\" font-size=\"16\" font-weight=\"bold\">"
    << esc("parity: " + model + " vs reference " + refname + " (ple-identity " +
           r["options"].value("ple_identity", "pad") + ")")
    << "</text>\n";
  std::string sub;
  if (r["teacher_forced"].is_object())
    sub += "teacher-forced top-1 " + std::to_string(r["teacher_forced"]["agree"].get<int64_t>()) +
           "/" + std::to_string(r["teacher_forced"]["steps"].get<int64_t>());
  if (r["image_gate"].is_object())
    sub += "; blank image " + std::to_string(r["image_gate"]["off"]["agree"].get<int64_t>()) + "/" +
           std::to_string(r["image_gate"]["off"]["steps"].get<int64_t>());
  sub += "; " + r["first_divergence"].value("text", std::string());
  o << "<text x=\"" << left << "\" y=\"50\" font-size=\"12\" fill=\"#333333\">" << esc(sub)
    << "</text>\n";

  auto frame = [&](double t, double b, const std::string& ytitle) {
    o << "<rect x=\"" << left << "\" y=\"" << t << "\" width=\"" << right - left << "\" height=\""
      << b - t << "\" fill=\"#fafafa\" stroke=\"#333333\"/>\n";
    o << "<text transform=\"translate(" << 22 << "," << (t + b) / 2
      << ") rotate(-90)\" text-anchor=\"middle\" font-size=\"13\">" << esc(ytitle) << "</text>\n";
    for (size_t l = 0; l < L; ++l) {
      o << "<line x1=\"" << num(xat(l)) << "\" y1=\"" << b << "\" x2=\"" << num(xat(l))
        << "\" y2=\"" << b + 5 << "\" stroke=\"#333333\"/>\n";
      o << "<text x=\"" << num(xat(l)) << "\" y=\"" << b + 18 << "\" text-anchor=\"middle\">" << l
        << "</text>\n";
    }
    o << "<text x=\"" << (left + right) / 2 << "\" y=\"" << b + 36
      << "\" text-anchor=\"middle\" font-size=\"13\">decoder layer</text>\n";
  };
  // Top: cosine.
  frame(top1, bot1, "cosine (min over rows)");
  for (int i = 0; i <= 5; ++i) {
    const double v = c_lo + (c_hi - c_lo) * i / 5.0, y = ycos(v);
    char lab[32];
    std::snprintf(lab, sizeof lab, (1.0 - c_lo) < 0.02 ? "%.4f" : "%.3f", v);
    o << "<line x1=\"" << left << "\" y1=\"" << num(y) << "\" x2=\"" << right << "\" y2=\""
      << num(y) << "\" stroke=\"#dddddd\"/>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">" << lab
      << "</text>\n";
  }
  o << "<line x1=\"" << left << "\" y1=\"" << num(ycos(1.0)) << "\" x2=\"" << right << "\" y2=\""
    << num(ycos(1.0)) << "\" stroke=\"#2b8a3e\" stroke-dasharray=\"2,3\"/>\n";
  // Bottom: max-abs.
  frame(top2, bot2, "max |ours - reference| (log)");
  for (double d = d_lo; d <= d_hi + 1e-9; d += 1) {
    const double y = ylog(std::pow(10.0, d));
    o << "<line x1=\"" << left << "\" y1=\"" << num(y) << "\" x2=\"" << right << "\" y2=\""
      << num(y) << "\" stroke=\"#dddddd\"/>\n"
      << "<text x=\"" << left - 6 << "\" y=\"" << num(y + 4) << "\" text-anchor=\"end\">1e"
      << static_cast<int>(d) << "</text>\n";
  }
  std::vector<std::pair<std::string, std::string>> tol_legend;
  for (const char* t : {"hidden_states", "per_layer_inputs"})
    if (taps.contains(t) && taps[t]["tolerance"].is_number()) {
      const double y = ylog(taps[t]["tolerance"].get<double>());
      const std::string dash = std::string(t) == "hidden_states" ? "8,3,2,3" : "2,2";
      o << "<line x1=\"" << left << "\" y1=\"" << num(y) << "\" x2=\"" << right << "\" y2=\""
        << num(y) << "\" stroke=\"#c92a2a\" stroke-width=\"1\" stroke-dasharray=\"" << dash
        << "\"/>\n";
      tol_legend.emplace_back(std::string(t) + " atol", dash);
    }
  // First diverging layer.
  const json& fd = r["first_divergence"];
  if (fd.value("found", false) && fd["layer"].is_number() &&
      fd["layer"].get<size_t>() < std::max<size_t>(L, 1)) {
    const double x = xat(fd["layer"].get<size_t>());
    for (auto [t, b] : {std::pair{top1, bot1}, std::pair{top2, bot2}})
      o << "<line x1=\"" << num(x) << "\" y1=\"" << t << "\" x2=\"" << num(x) << "\" y2=\"" << b
        << "\" stroke=\"#c92a2a\" stroke-width=\"2\" opacity=\"0.5\"/>\n";
    o << "<text x=\"" << num(x + 4) << "\" y=\"" << top1 + 14 << "\" fill=\"#c92a2a\">first "
      << "diverging</text>\n";
  }
  auto draw = [&](const Series& s, const std::vector<double>& v, auto ymap) {
    std::string pts;
    for (size_t l = 0; l < v.size(); ++l)
      if (std::isfinite(v[l])) pts += num(xat(l)) + "," + num(ymap(v[l])) + " ";
    o << "<polyline fill=\"none\" stroke=\"" << s.color << "\" stroke-width=\"2\""
      << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << " points=\"" << pts
      << "\"/>\n";
    for (size_t l = 0; l < v.size(); ++l) {
      if (!std::isfinite(v[l])) continue;
      const double x = xat(l), y = ymap(v[l]);
      if (s.marker == "square")
        o << "<rect x=\"" << num(x - 4) << "\" y=\"" << num(y - 4)
          << "\" width=\"8\" height=\"8\" fill=\"" << s.color << "\"/>\n";
      else
        o << "<circle cx=\"" << num(x) << "\" cy=\"" << num(y) << "\" r=\"4\" fill=\""
          << (s.dash.empty() ? s.color : "#ffffff") << "\" stroke=\"" << s.color << "\"/>\n";
    }
  };
  for (const Series& s : series) {
    draw(s, s.cos, ycos);
    draw(s, s.max_abs, ylog);
  }
  // Legend.
  double ly = top1 + 10;
  const double lx = right + 20;
  o << "<text x=\"" << lx << "\" y=\"" << ly << "\" font-weight=\"bold\">legend</text>\n";
  ly += 20;
  for (const Series& s : series) {
    o << "<line x1=\"" << lx << "\" y1=\"" << ly - 4 << "\" x2=\"" << lx + 30 << "\" y2=\""
      << ly - 4 << "\" stroke=\"" << s.color << "\" stroke-width=\"2\""
      << (s.dash.empty() ? "" : " stroke-dasharray=\"" + s.dash + "\"") << "/>\n";
    if (s.marker == "square")
      o << "<rect x=\"" << lx + 11 << "\" y=\"" << ly - 8 << "\" width=\"8\" height=\"8\" fill=\""
        << s.color << "\"/>\n";
    else
      o << "<circle cx=\"" << lx + 15 << "\" cy=\"" << ly - 4 << "\" r=\"4\" fill=\""
        << (s.dash.empty() ? s.color : "#ffffff") << "\" stroke=\"" << s.color << "\"/>\n";
    o << "<text x=\"" << lx + 38 << "\" y=\"" << ly << "\">" << esc(s.label) << "</text>\n";
    ly += 20;
  }
  for (const auto& [label, dash] : tol_legend) {
    o << "<line x1=\"" << lx << "\" y1=\"" << ly - 4 << "\" x2=\"" << lx + 30 << "\" y2=\""
      << ly - 4 << "\" stroke=\"#c92a2a\" stroke-dasharray=\"" << dash << "\"/>\n";
    o << "<text x=\"" << lx + 38 << "\" y=\"" << ly << "\">" << esc(label) << "</text>\n";
    ly += 20;
  }
  if (series.empty())
    o << "<text x=\"" << (left + right) / 2 << "\" y=\"" << (top1 + bot1) / 2
      << "\" text-anchor=\"middle\">no per-layer taps in both runs</text>\n";
  o << "</svg>\n";
  return o.str();
}

}  // namespace gemstage
