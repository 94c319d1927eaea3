// Small text helpers the bench's reports share (the sweep's report.cpp and
// the serving benchmark's serve_bench.cpp): number formatting, CSV and
// Markdown cells, shell quoting, and running gnuplot.
#pragma once

#include <string>
#include <utility>

namespace kvq::bench {

std::string num(double v, int decimals);  // fixed decimals
std::string sig(double v);                // significant digits for a table: 1234, 123.4, ..., 0.1234
std::string csv_field(const std::string& s);  // quoted where needed
std::string md(std::string s);                // a Markdown table cell: no pipes or newlines inside
std::string sh_quote(const std::string& s);   // one shell word
// Runs a shell command; returns (exit status, combined output).
std::pair<int, std::string> run_command(const std::string& cmd);

}  // namespace kvq::bench
