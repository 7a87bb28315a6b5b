// Python-level helpers of fusedopt._C that the optimizer's plan cache calls on every step
// (Note [identity scans]); fusedopt/_identity.py calls them and has a Python fallback of each.
#pragma once

#include <Python.h>
#include <torch/extension.h>

namespace fusedopt {
namespace cpu {

// Note [identity scans]: the plan cache (fusedopt/optim.py, Note [plan cache]) asks on every step
// whether each param's state dict still holds the state tensors its cached lists were built
// from. In Python that is one `map(itemgetter(key), dicts)` scan per state key, each taking a
// new reference to every tensor (so touching every tensor object) and missing the cache on
// every dict once a step's data streams have evicted them: ~0.2 ms per key for 4000 params. Here
// one loop looks up every key of a dict while its lines are in cache, with borrowed references,
// and prefetches the dicts ahead.
constexpr Py_ssize_t kAheadDict = 16;

// Whether dicts[i][keys[j]] is lists[j][i] for every i and j: dicts a list of dicts, keys a
// tuple of str, lists a tuple (one per key) of lists as long as dicts. A missing key, a non-dict
// or a list of another length answers false.
inline bool entries_are(const pybind11::list& dicts, const pybind11::tuple& keys,
                        const pybind11::tuple& lists) {
  PyObject* const ds = dicts.ptr();
  const Py_ssize_t n = PyList_GET_SIZE(ds);
  const Py_ssize_t k = PyTuple_GET_SIZE(keys.ptr());
  if (PyTuple_GET_SIZE(lists.ptr()) != k) {
    throw pybind11::value_error("entries_are: one list per key expected");
  }
  for (Py_ssize_t j = 0; j < k; ++j) {
    PyObject* l = PyTuple_GET_ITEM(lists.ptr(), j);
    if (!PyList_Check(l) || PyList_GET_SIZE(l) != n) return false;
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + kAheadDict < n) __builtin_prefetch(PyList_GET_ITEM(ds, i + kAheadDict));
    if (i + kAheadDict / 2 < n) {  // its keys table, the dict object having come in before
      PyObject* ahead = PyList_GET_ITEM(ds, i + kAheadDict / 2);
      if (PyDict_CheckExact(ahead)) {
        const char* table = reinterpret_cast<const char*>(
            reinterpret_cast<PyDictObject*>(ahead)->ma_keys);
        __builtin_prefetch(table);
        __builtin_prefetch(table + 64);
      }
    }
    PyObject* d = PyList_GET_ITEM(ds, i);
    if (!PyDict_Check(d)) return false;
    for (Py_ssize_t j = 0; j < k; ++j) {
      PyObject* v = PyDict_GetItemWithError(d, PyTuple_GET_ITEM(keys.ptr(), j));  // borrowed
      if (v == nullptr) {
        if (PyErr_Occurred()) throw pybind11::error_already_set();
        return false;
      }
      if (v != PyList_GET_ITEM(PyTuple_GET_ITEM(lists.ptr(), j), i)) return false;
    }
  }
  return true;
}

// Whether a and b (lists) hold the same objects in the same order.
inline bool items_are(const pybind11::list& a, const pybind11::list& b) {
  const Py_ssize_t n = PyList_GET_SIZE(a.ptr());
  if (PyList_GET_SIZE(b.ptr()) != n) return false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (PyList_GET_ITEM(a.ptr(), i) != PyList_GET_ITEM(b.ptr(), i)) return false;
  }
  return true;
}

// Whether the items of d, in its order, are exactly (keys[i], values[i]) (keys and values lists).
inline bool dict_items_are(const pybind11::dict& d, const pybind11::list& keys,
                           const pybind11::list& values) {
  const Py_ssize_t n = PyList_GET_SIZE(keys.ptr());
  if (PyDict_GET_SIZE(d.ptr()) != n || PyList_GET_SIZE(values.ptr()) != n) return false;
  Py_ssize_t pos = 0, i = 0;
  PyObject *key, *value;  // borrowed
  while (PyDict_Next(d.ptr(), &pos, &key, &value)) {
    if (key != PyList_GET_ITEM(keys.ptr(), i) || value != PyList_GET_ITEM(values.ptr(), i)) {
      return false;
    }
    ++i;
  }
  return i == n;
}

}  // namespace cpu
}  // namespace fusedopt
