// Index builders for the BERT dataset, compiled ahead of time by setup.py (megabert.data._helpers).
//
// build_sample_mapping: which sentences make each sample. Python would take minutes for
// a corpus of millions of documents; this is one linear pass plus a shuffle.
// build_blending_indices: which dataset serves each sample of a weighted blend.
//
// Random numbers come from std::mt19937 / std::mt19937_64 used raw (no std::*_distribution,
// whose output differs between standard libraries), so a mapping is the same on every platform.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

namespace py = pybind11;

namespace {

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using Int32Array = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// A uniform double in [0, 1) from the top 53 bits of a 64-bit draw.
inline double uniform01(std::mt19937_64 &gen) {
  return static_cast<double>(gen() >> 11) * (1.0 / 9007199254740992.0);
}

// The token budget of the next sample: usually max_length; with probability short_seq_prob a
// length drawn uniformly from [2, max_length], so the model also sees short inputs (BERT's recipe).
inline int64_t target_length(std::mt19937_64 &gen, double short_seq_prob, int64_t max_length) {
  if (short_seq_prob > 0.0 && uniform01(gen) < short_seq_prob) {
    return 2 + static_cast<int64_t>(gen() % static_cast<uint64_t>(max_length - 1));
  }
  return max_length;
}

template <typename T>
py::array to_numpy_rows(std::vector<T> &&flat, int64_t cols) {
  auto *heap = new std::vector<T>(std::move(flat));
  py::capsule owner(heap, [](void *p) { delete static_cast<std::vector<T> *>(p); });
  const int64_t rows = static_cast<int64_t>(heap->size()) / cols;
  return py::array_t<T>({rows, cols}, {static_cast<int64_t>(sizeof(T)) * cols, static_cast<int64_t>(sizeof(T))},
                        heap->data(), owner);
}

template <typename T>
struct Mapping {
  std::vector<T> rows;  // flattened rows of (first sentence, end sentence, target length)
  int64_t empty_docs = 0, short_docs = 0, usable_docs = 0, epochs = 0;
};

template <typename T>
Mapping<T> compute_mapping(const int64_t *docs, int64_t num_docs, const int32_t *sizes, int64_t num_epochs,
                           int64_t max_num_samples, int64_t max_seq_length, double short_seq_prob, uint64_t seed,
                           int64_t min_num_sent) {
  Mapping<T> out;
  std::vector<T> &maps = out.rows;
  std::mt19937_64 gen(seed);
  const int64_t min_left = std::max<int64_t>(min_num_sent, 1);

  for (int64_t epoch = 0; epoch < num_epochs; ++epoch) {
    if (max_num_samples >= 0 && static_cast<int64_t>(maps.size() / 3) >= max_num_samples) break;
    const size_t before = maps.size();
    for (int64_t d = 0; d < num_docs; ++d) {
      const int64_t first = docs[d], last = docs[d + 1];
      const int64_t num_sent = last - first;
      if (num_sent == 0 || num_sent < min_num_sent) {
        if (epoch == 0) ++(num_sent == 0 ? out.empty_docs : out.short_docs);
        continue;
      }
      if (epoch == 0) ++out.usable_docs;
      // Accumulate sentences until the budget is met, but never leave fewer than min_num_sent
      // sentences at the document's end: they could not form a sample, so the last one takes them.
      int64_t start = first, tokens = 0, target = target_length(gen, short_seq_prob, max_seq_length);
      for (int64_t s = first; s < last; ++s) {
        tokens += sizes[s];
        const int64_t taken = s + 1 - start, left = last - s - 1;
        if ((tokens >= target && left >= min_left && taken >= min_num_sent) || left == 0) {
          maps.push_back(static_cast<T>(start));
          maps.push_back(static_cast<T>(s + 1));
          maps.push_back(static_cast<T>(target));
          start = s + 1;
          tokens = 0;
          target = target_length(gen, short_seq_prob, max_seq_length);
        }
      }
    }
    ++out.epochs;
    if (maps.size() == before) break;  // nothing usable: more epochs would loop forever
  }

  // Fisher-Yates over rows with its own stream, so the order does not depend on the epoch count.
  std::mt19937_64 shuffle_gen(seed + 1);
  const int64_t rows = static_cast<int64_t>(maps.size() / 3);
  for (int64_t i = rows - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(shuffle_gen() % static_cast<uint64_t>(i + 1));
    for (int k = 0; k < 3; ++k) std::swap(maps[3 * i + k], maps[3 * j + k]);
  }
  return out;
}

template <typename T>
py::tuple mapping_to_python(Mapping<T> &&m) {
  py::dict stats;
  stats["empty_docs"] = m.empty_docs;
  stats["short_docs"] = m.short_docs;
  stats["usable_docs"] = m.usable_docs;
  stats["epochs"] = m.epochs;
  return py::make_tuple(to_numpy_rows<T>(std::move(m.rows), 3), stats);
}

// docs: document boundaries as sentence indices [num_docs + 1]; sizes: tokens per sentence.
// Returns (mapping [samples, 3] of (first sentence, end sentence, target length), stats dict).
// Epochs repeat until max_num_samples rows exist (max_num_samples < 0: one epoch).
py::tuple build_sample_mapping(const Int64Array &docs_, const Int32Array &sizes_, int64_t num_epochs,
                               int64_t max_num_samples, int64_t max_seq_length, double short_seq_prob, uint64_t seed,
                               int64_t min_num_sent) {
  if (docs_.ndim() != 1 || docs_.shape(0) < 1) throw std::invalid_argument("docs must be 1-D with at least one entry");
  if (sizes_.ndim() != 1) throw std::invalid_argument("sizes must be 1-D");
  if (max_seq_length < 2) throw std::invalid_argument("max_seq_length must be at least 2");
  if (short_seq_prob < 0.0 || short_seq_prob > 1.0) throw std::invalid_argument("short_seq_prob must be in [0, 1]");
  if (num_epochs < 1) throw std::invalid_argument("num_epochs must be at least 1");
  const int64_t *docs = docs_.data();
  const int64_t num_docs = docs_.shape(0) - 1;
  for (int64_t d = 0; d < num_docs; ++d) {
    if (docs[d] > docs[d + 1] || docs[d] < 0 || docs[d + 1] > sizes_.shape(0))
      throw std::out_of_range("document boundaries out of range at document " + std::to_string(d));
  }
  const int32_t *sizes = sizes_.data();
  // Sentence indices fit 32 bits in all but the largest corpora: half the memory for the mapping.
  if (sizes_.shape(0) < static_cast<int64_t>(std::numeric_limits<uint32_t>::max())) {
    Mapping<uint32_t> m;
    {
      py::gil_scoped_release release;  // pure C++ from here; the input arrays outlive this call
      m = compute_mapping<uint32_t>(docs, num_docs, sizes, num_epochs, max_num_samples, max_seq_length,
                                    short_seq_prob, seed, min_num_sent);
    }
    return mapping_to_python(std::move(m));
  }
  Mapping<int64_t> m;
  {
    py::gil_scoped_release release;
    m = compute_mapping<int64_t>(docs, num_docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob,
                                 seed, min_num_sent);
  }
  return mapping_to_python(std::move(m));
}

// Greedy weighted interleaving: sample i goes to the dataset furthest behind its share
// weight[k] * (i + 1), so every prefix of the blend follows the weights as closely as possible.
py::tuple build_blending_indices(const py::array_t<double, py::array::c_style | py::array::forcecast> &weights_,
                                 int64_t size) {
  const int64_t k = weights_.shape(0);
  if (k < 1 || k > std::numeric_limits<int16_t>::max()) throw std::invalid_argument("need 1 to 32767 datasets");
  const double *weights = weights_.data();
  py::array_t<int16_t> dataset_index(size);
  py::array_t<int64_t> sample_index(size);
  auto di = dataset_index.mutable_unchecked<1>();
  auto si = sample_index.mutable_unchecked<1>();
  std::vector<int64_t> taken(k, 0);
  for (int64_t i = 0; i < size; ++i) {
    int64_t best = 0;
    double best_gap = -std::numeric_limits<double>::infinity();
    for (int64_t j = 0; j < k; ++j) {
      const double gap = weights[j] * static_cast<double>(i + 1) - static_cast<double>(taken[j]);
      if (gap > best_gap) {
        best_gap = gap;
        best = j;
      }
    }
    di(i) = static_cast<int16_t>(best);
    si(i) = taken[best]++;
  }
  return py::make_tuple(dataset_index, sample_index);
}

}  // namespace

PYBIND11_MODULE(_helpers, m) {
  m.doc() = "megabert's C++ index builders for BERT datasets";
  m.def("build_sample_mapping", &build_sample_mapping, py::arg("docs"), py::arg("sizes"), py::arg("num_epochs"),
        py::arg("max_num_samples"), py::arg("max_seq_length"), py::arg("short_seq_prob"), py::arg("seed"),
        py::arg("min_num_sent"));
  m.def("build_blending_indices", &build_blending_indices, py::arg("weights"), py::arg("size"));
}
