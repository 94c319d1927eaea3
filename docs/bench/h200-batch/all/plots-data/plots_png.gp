set terminal pngcairo size 1100,650 background '#ffffff' font 'sans,11'
set grid
set key outside right top noenhanced
set logscale x 2
set yrange [0:*]
set offsets graph 0.04, graph 0.04, graph 0.05, 0
set xlabel 'context (prompt tokens)'
set output 'tps_vs_ctx.png'
set title 'Decode tok/s vs context (median; bars: min..max of 3 reps)'
set ylabel 'decode tok/s'
plot 'plots-data/codec0.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/codec1.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 2 title 'k8v8', \
     'plots-data/codec2.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 3 title 'k8v4', \
     'plots-data/codec3.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 4 title 'k8vturbo3', \
     'plots-data/codec4.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 5 title 'k8vturbo2', \
     'plots-data/codec5.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 6 title 'k8vturbo3tcq', \
     'plots-data/codec6.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 7 title 'k8vturbo2tcq', \
     'plots-data/codec7.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 8 title 'tsym3', \
     'plots-data/codec8.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 9 title 'tsym4', \
     'plots-data/codec9.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 10 title 'planar', \
     'plots-data/codec10.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 11 title 'planar3', \
     'plots-data/codec11.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 12 title 'planar_k', \
     'plots-data/codec12.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 13 title 'iso3', \
     'plots-data/codec13.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 14 title 'iso4', \
     'plots-data/codec14.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 15 title 'iso3_sym', \
     'plots-data/codec15.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 16 title 'iso4_sym', \
     'plots-data/codec16.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 17 title 'k_iso3', \
     'plots-data/codec17.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 18 title 'k_iso4', \
     'plots-data/codec18.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 19 title 'rotor3', \
     'plots-data/codec19.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 20 title 'rotor4', \
     'plots-data/codec20.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 21 title 'rotor3_sym', \
     'plots-data/codec21.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 22 title 'rotor4_sym', \
     'plots-data/codec22.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 23 title 'k_rotor3', \
     'plots-data/codec23.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 24 title 'k_rotor4', \
     'plots-data/codec24.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 25 title 'rot_k_tq4v', \
     'plots-data/codec25.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 26 title 'fp8'
set output 'kv_mib_vs_ctx.png'
set title 'KV cache MiB vs context (counted by the cache)'
set ylabel 'KV MiB'
plot 'plots-data/codec0.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/codec1.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 2 title 'k8v8', \
     'plots-data/codec2.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 3 title 'k8v4', \
     'plots-data/codec3.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 4 title 'k8vturbo3', \
     'plots-data/codec4.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 5 title 'k8vturbo2', \
     'plots-data/codec5.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 6 title 'k8vturbo3tcq', \
     'plots-data/codec6.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 7 title 'k8vturbo2tcq', \
     'plots-data/codec7.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 8 title 'tsym3', \
     'plots-data/codec8.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 9 title 'tsym4', \
     'plots-data/codec9.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 10 title 'planar', \
     'plots-data/codec10.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 11 title 'planar3', \
     'plots-data/codec11.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 12 title 'planar_k', \
     'plots-data/codec12.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 13 title 'iso3', \
     'plots-data/codec13.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 14 title 'iso4', \
     'plots-data/codec14.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 15 title 'iso3_sym', \
     'plots-data/codec15.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 16 title 'iso4_sym', \
     'plots-data/codec16.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 17 title 'k_iso3', \
     'plots-data/codec17.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 18 title 'k_iso4', \
     'plots-data/codec18.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 19 title 'rotor3', \
     'plots-data/codec19.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 20 title 'rotor4', \
     'plots-data/codec20.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 21 title 'rotor3_sym', \
     'plots-data/codec21.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 22 title 'rotor4_sym', \
     'plots-data/codec22.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 23 title 'k_rotor3', \
     'plots-data/codec23.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 24 title 'k_rotor4', \
     'plots-data/codec24.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 25 title 'rot_k_tq4v', \
     'plots-data/codec25.dat' using 1:5 with linespoints pt 7 ps 0.6 lc 26 title 'fp8'
unset logscale x
set xlabel 'KV tokens attended per step / 1000'
set output 'itl_fit.png'
set title 'Inter-token latency (p50) vs KV length, with fits ITL = a + b * kv/1000'
set ylabel 'ITL p50 (ms)'
plot 'plots-data/codec0.dat' using 6:7 with points pt 7 ps 0.8 lc 1 title 'none', \
     'plots-data/codec1.dat' using 6:7 with points pt 7 ps 0.8 lc 2 title 'k8v8', \
     'plots-data/codec2.dat' using 6:7 with points pt 7 ps 0.8 lc 3 title 'k8v4', \
     'plots-data/codec3.dat' using 6:7 with points pt 7 ps 0.8 lc 4 title 'k8vturbo3', \
     'plots-data/codec4.dat' using 6:7 with points pt 7 ps 0.8 lc 5 title 'k8vturbo2', \
     'plots-data/codec5.dat' using 6:7 with points pt 7 ps 0.8 lc 6 title 'k8vturbo3tcq', \
     'plots-data/codec6.dat' using 6:7 with points pt 7 ps 0.8 lc 7 title 'k8vturbo2tcq', \
     'plots-data/codec7.dat' using 6:7 with points pt 7 ps 0.8 lc 8 title 'tsym3', \
     'plots-data/codec8.dat' using 6:7 with points pt 7 ps 0.8 lc 9 title 'tsym4', \
     'plots-data/codec9.dat' using 6:7 with points pt 7 ps 0.8 lc 10 title 'planar', \
     'plots-data/codec10.dat' using 6:7 with points pt 7 ps 0.8 lc 11 title 'planar3', \
     'plots-data/codec11.dat' using 6:7 with points pt 7 ps 0.8 lc 12 title 'planar_k', \
     'plots-data/codec12.dat' using 6:7 with points pt 7 ps 0.8 lc 13 title 'iso3', \
     'plots-data/codec13.dat' using 6:7 with points pt 7 ps 0.8 lc 14 title 'iso4', \
     'plots-data/codec14.dat' using 6:7 with points pt 7 ps 0.8 lc 15 title 'iso3_sym', \
     'plots-data/codec15.dat' using 6:7 with points pt 7 ps 0.8 lc 16 title 'iso4_sym', \
     'plots-data/codec16.dat' using 6:7 with points pt 7 ps 0.8 lc 17 title 'k_iso3', \
     'plots-data/codec17.dat' using 6:7 with points pt 7 ps 0.8 lc 18 title 'k_iso4', \
     'plots-data/codec18.dat' using 6:7 with points pt 7 ps 0.8 lc 19 title 'rotor3', \
     'plots-data/codec19.dat' using 6:7 with points pt 7 ps 0.8 lc 20 title 'rotor4', \
     'plots-data/codec20.dat' using 6:7 with points pt 7 ps 0.8 lc 21 title 'rotor3_sym', \
     'plots-data/codec21.dat' using 6:7 with points pt 7 ps 0.8 lc 22 title 'rotor4_sym', \
     'plots-data/codec22.dat' using 6:7 with points pt 7 ps 0.8 lc 23 title 'k_rotor3', \
     'plots-data/codec23.dat' using 6:7 with points pt 7 ps 0.8 lc 24 title 'k_rotor4', \
     'plots-data/codec24.dat' using 6:7 with points pt 7 ps 0.8 lc 25 title 'rot_k_tq4v', \
     'plots-data/codec25.dat' using 6:7 with points pt 7 ps 0.8 lc 26 title 'fp8'
