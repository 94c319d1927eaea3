set terminal svg size 1100,650 dynamic background '#ffffff' font 'sans,12'
set grid
set key outside right top noenhanced
set logscale x 2
set yrange [0:*]
set offsets graph 0.04, graph 0.04, graph 0.05, 0
set xlabel 'context (prompt tokens)'
set output 'tps_vs_ctx.svg'
set title 'Decode tok/s vs context (median; bars: min..max of 3 reps)'
set ylabel 'decode tok/s'
plot 'plots-data/codec0.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/codec1.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 2 title 'tsym3', \
     'plots-data/codec2.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 3 title 'k8vturbo2'
set output 'kv_mib_vs_ctx.svg'
set title 'KV cache MiB vs context (counted by the cache)'
set ylabel 'KV MiB'
plot 'plots-data/codec0.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/codec1.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 2 title 'tsym3', \
     'plots-data/codec2.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 3 title 'k8vturbo2'
unset logscale x
set xlabel 'KV tokens attended per step / 1000'
set output 'itl_fit.svg'
set title 'Inter-token latency (p50) vs KV length, with fits ITL = a + b * kv/1000'
set ylabel 'ITL p50 (ms)'
plot 'plots-data/codec0.dat' using 6:7 with points pt 7 ps 0.8 lc 1 title 'none', \
     'plots-data/codec1.dat' using 6:7 with points pt 7 ps 0.8 lc 2 title 'tsym3', \
     'plots-data/codec2.dat' using 6:7 with points pt 7 ps 0.8 lc 3 title 'k8vturbo2'
