set terminal png size 1100,650 background '#ffffff'
set grid
set key outside right top noenhanced
set logscale x 2
set yrange [0:*]
set offsets graph 0.04, graph 0.04, graph 0.05, 0
set xlabel 'sequences per decode step'
set ylabel 'aggregate decode tok/s'
set title 'Aggregate decode tok/s vs batch (median; bars: min..max)'
set output 'tps_vs_batch.png'
plot 'plots-data/batch0.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 1 title 'none', \
     'plots-data/batch1.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 2 title 'k8v8', \
     'plots-data/batch2.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 3 title 'k8v4', \
     'plots-data/batch3.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 4 title 'k8vturbo3', \
     'plots-data/batch4.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 5 title 'k8vturbo2', \
     'plots-data/batch5.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 6 title 'k8vturbo3tcq', \
     'plots-data/batch6.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 7 title 'k8vturbo2tcq', \
     'plots-data/batch7.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 8 title 'tsym3', \
     'plots-data/batch8.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 9 title 'tsym4', \
     'plots-data/batch9.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 10 title 'planar', \
     'plots-data/batch10.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 11 title 'planar3', \
     'plots-data/batch11.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 12 title 'planar_k', \
     'plots-data/batch12.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 13 title 'iso3', \
     'plots-data/batch13.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 14 title 'iso4', \
     'plots-data/batch14.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 15 title 'iso3_sym', \
     'plots-data/batch15.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 16 title 'iso4_sym', \
     'plots-data/batch16.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 17 title 'k_iso3', \
     'plots-data/batch17.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 18 title 'k_iso4', \
     'plots-data/batch18.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 19 title 'rotor3', \
     'plots-data/batch19.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 20 title 'rotor4', \
     'plots-data/batch20.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 21 title 'rotor3_sym', \
     'plots-data/batch21.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 22 title 'rotor4_sym', \
     'plots-data/batch22.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 23 title 'k_rotor3', \
     'plots-data/batch23.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 24 title 'k_rotor4', \
     'plots-data/batch24.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 25 title 'rot_k_tq4v', \
     'plots-data/batch25.dat' using 1:2:3:4 with yerrorlines pt 7 ps 0.6 lc 26 title 'fp8'
