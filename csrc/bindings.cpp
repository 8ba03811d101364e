// Python bindings for the quartic solver: conversion only, no numerics.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "quartic.hpp"

namespace py = pybind11;

namespace {

using CoeffArray = py::array_t<double, py::array::c_style | py::array::forcecast>;

py::tuple solve(const CoeffArray& coeffs, int threads) {
    if (coeffs.ndim() != 2 || coeffs.shape(1) != 5) {
        std::string shape = "(";
        for (py::ssize_t i = 0; i < coeffs.ndim(); ++i) {
            shape += (i ? ", " : "") + std::to_string(coeffs.shape(i));
        }
        shape += coeffs.ndim() == 1 ? ",)" : ")";
        throw std::invalid_argument("solve: expected coeffs of shape [N, 5], got coeffs.shape=" + shape);
    }
    const auto n_rows = static_cast<std::size_t>(coeffs.shape(0));
    py::array_t<double> roots(static_cast<py::ssize_t>(n_rows));
    py::array_t<std::int8_t> n_positive(static_cast<py::ssize_t>(n_rows));
    const double* in = coeffs.data();
    double* out_roots = roots.mutable_data();
    std::int8_t* out_count = n_positive.mutable_data();
    {
        py::gil_scoped_release release;
        normfast::solve_quartic_batch(in, n_rows, out_roots, out_count, threads);
    }
    return py::make_tuple(roots, n_positive);
}

}  // namespace

PYBIND11_MODULE(_quartic, m) {
    m.doc() = "Batched solver for a R^4 + b R^3 + c R^2 + d R + e = 0 (largest positive root, count).";
    m.def("solve", &solve, py::arg("coeffs"), py::arg("threads") = 0,
          "solve(coeffs: float64[N, 5], threads=0) -> (roots float64[N], n_positive int8[N]).\n\n"
          "roots: largest positive real root per row (NaN where none); n_positive: number of\n"
          "distinct positive real roots. threads <= 0 uses the OpenMP default.");
    m.def("default_threads", &normfast::default_threads,
          "OpenMP's default team size (1 when built without OpenMP).");
    m.attr("touch_factor") = normfast::kTouchFactor;
}
