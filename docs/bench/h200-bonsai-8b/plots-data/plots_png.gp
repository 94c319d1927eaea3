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
     1.553102 + 0.035571 * x with lines dt 2 lc 1 title 'none fit', \
     'plots-data/codec1.dat' using 6:7 with points pt 7 ps 0.8 lc 2 title 'k8v8', \
     1.553625 + 0.027147 * x with lines dt 2 lc 2 title 'k8v8 fit', \
     'plots-data/codec2.dat' using 6:7 with points pt 7 ps 0.8 lc 3 title 'k8v4', \
     1.661335 + 0.026765 * x with lines dt 2 lc 3 title 'k8v4 fit', \
     'plots-data/codec3.dat' using 6:7 with points pt 7 ps 0.8 lc 4 title 'k8vturbo3', \
     1.643691 + 0.026923 * x with lines dt 2 lc 4 title 'k8vturbo3 fit', \
     'plots-data/codec4.dat' using 6:7 with points pt 7 ps 0.8 lc 5 title 'k8vturbo2', \
     1.647029 + 0.023380 * x with lines dt 2 lc 5 title 'k8vturbo2 fit', \
     'plots-data/codec5.dat' using 6:7 with points pt 7 ps 0.8 lc 6 title 'k8vturbo3tcq', \
     1.675034 + 0.029163 * x with lines dt 2 lc 6 title 'k8vturbo3tcq fit', \
     'plots-data/codec6.dat' using 6:7 with points pt 7 ps 0.8 lc 7 title 'k8vturbo2tcq', \
     1.658909 + 0.027573 * x with lines dt 2 lc 7 title 'k8vturbo2tcq fit', \
     'plots-data/codec7.dat' using 6:7 with points pt 7 ps 0.8 lc 8 title 'tsym3', \
     1.573873 + 0.029591 * x with lines dt 2 lc 8 title 'tsym3 fit', \
     'plots-data/codec8.dat' using 6:7 with points pt 7 ps 0.8 lc 9 title 'tsym4', \
     1.632409 + 0.025224 * x with lines dt 2 lc 9 title 'tsym4 fit', \
     'plots-data/codec9.dat' using 6:7 with points pt 7 ps 0.8 lc 10 title 'planar', \
     1.712360 + 0.029165 * x with lines dt 2 lc 10 title 'planar fit', \
     'plots-data/codec10.dat' using 6:7 with points pt 7 ps 0.8 lc 11 title 'planar3', \
     1.688004 + 0.030812 * x with lines dt 2 lc 11 title 'planar3 fit', \
     'plots-data/codec11.dat' using 6:7 with points pt 7 ps 0.8 lc 12 title 'planar_k', \
     1.638530 + 0.034864 * x with lines dt 2 lc 12 title 'planar_k fit', \
     'plots-data/codec12.dat' using 6:7 with points pt 7 ps 0.8 lc 13 title 'iso3', \
     1.746043 + 0.030203 * x with lines dt 2 lc 13 title 'iso3 fit', \
     'plots-data/codec13.dat' using 6:7 with points pt 7 ps 0.8 lc 14 title 'iso4', \
     1.756527 + 0.029241 * x with lines dt 2 lc 14 title 'iso4 fit', \
     'plots-data/codec14.dat' using 6:7 with points pt 7 ps 0.8 lc 15 title 'iso3_sym', \
     1.658508 + 0.031983 * x with lines dt 2 lc 15 title 'iso3_sym fit', \
     'plots-data/codec15.dat' using 6:7 with points pt 7 ps 0.8 lc 16 title 'iso4_sym', \
     1.732098 + 0.031426 * x with lines dt 2 lc 16 title 'iso4_sym fit', \
     'plots-data/codec16.dat' using 6:7 with points pt 7 ps 0.8 lc 17 title 'k_iso3', \
     1.644805 + 0.033869 * x with lines dt 2 lc 17 title 'k_iso3 fit', \
     'plots-data/codec17.dat' using 6:7 with points pt 7 ps 0.8 lc 18 title 'k_iso4', \
     1.672740 + 0.034343 * x with lines dt 2 lc 18 title 'k_iso4 fit', \
     'plots-data/codec18.dat' using 6:7 with points pt 7 ps 0.8 lc 19 title 'rotor3', \
     1.720197 + 0.030651 * x with lines dt 2 lc 19 title 'rotor3 fit', \
     'plots-data/codec19.dat' using 6:7 with points pt 7 ps 0.8 lc 20 title 'rotor4', \
     1.741877 + 0.029273 * x with lines dt 2 lc 20 title 'rotor4 fit', \
     'plots-data/codec20.dat' using 6:7 with points pt 7 ps 0.8 lc 21 title 'rotor3_sym', \
     1.648682 + 0.032048 * x with lines dt 2 lc 21 title 'rotor3_sym fit', \
     'plots-data/codec21.dat' using 6:7 with points pt 7 ps 0.8 lc 22 title 'rotor4_sym', \
     1.699240 + 0.031747 * x with lines dt 2 lc 22 title 'rotor4_sym fit', \
     'plots-data/codec22.dat' using 6:7 with points pt 7 ps 0.8 lc 23 title 'k_rotor3', \
     1.628576 + 0.033987 * x with lines dt 2 lc 23 title 'k_rotor3 fit', \
     'plots-data/codec23.dat' using 6:7 with points pt 7 ps 0.8 lc 24 title 'k_rotor4', \
     1.664011 + 0.034248 * x with lines dt 2 lc 24 title 'k_rotor4 fit', \
     'plots-data/codec24.dat' using 6:7 with points pt 7 ps 0.8 lc 25 title 'rot_k_tq4v', \
     1.666092 + 0.027166 * x with lines dt 2 lc 25 title 'rot_k_tq4v fit', \
     'plots-data/codec25.dat' using 6:7 with points pt 7 ps 0.8 lc 26 title 'fp8', \
     1.619046 + 0.021643 * x with lines dt 2 lc 26 title 'fp8 fit'
